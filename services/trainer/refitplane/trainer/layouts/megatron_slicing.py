"""What every Megatron parameter rule starts from: this rank's place in Megatron's meshes
(`MegatronParallel`), the model's GLU interleaving (`GluInterleave`), the parameter being
mapped with what blames it (`MegatronParam`), and the slices the rules cut from it, all
views: a whole tensor, a row or column chunk, and `[gate; up]` halves or interleaved
blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import full_box
from refitplane.trainer.layouts.dims import ModelDims
from refitplane.trainer.layouts.held import HeldSlice


@dataclass(frozen=True, slots=True)
class MegatronParallel:
    """This rank's place in Megatron's dense (TP) and expert (EP x expert-TP) meshes."""

    rank: int
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise LayoutError(f"rank {self.rank} is negative", field="rank")
        for label, r, n in (
            ("tensor parallel", self.tp_rank, self.tp_size),
            ("expert parallel", self.ep_rank, self.ep_size),
            ("expert tensor parallel", self.etp_rank, self.etp_size),
        ):
            if n < 1 or not 0 <= r < n:
                raise LayoutError(
                    f"{label} rank {r} of size {n} is out of range",
                    rank=self.rank,
                    field="parallel",
                )


@dataclass(frozen=True, slots=True)
class GluInterleave:
    """Block sizes of Megatron's block-interleaved GLU fc1 layout; None keeps `[gate; up]`.

    `experts` is `moe_mlp_glu_interleave_size` (read by TEGroupedMLP's forward), and
    `shared_experts` is `moe_shared_expert_glu_interleave_size` (Megatron-LM
    megatron/core/transformer/transformer_config.py). With a size `k`, each rank's fc1
    rows are `[gate 0:k; up 0:k; gate k:2k; up k:2k; ...]` of its own gate and up rows
    (TEGroupedMLP._remove_glu_interleaving in megatron/core/transformer/moe/experts.py;
    Megatron-Bridge interleaves each rank's checkpoint shard the same way on load,
    _interleave_glu_tensor in src/megatron/bridge/training/checkpointing.py). Nothing in
    the shapes shows it, so it must come from the model's config.
    """

    experts: int | None = None
    shared_experts: int | None = None

    def __post_init__(self) -> None:
        for field, value in (
            ("moe_mlp_glu_interleave_size", self.experts),
            ("moe_shared_expert_glu_interleave_size", self.shared_experts),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                raise LayoutError(f"{field} must be a positive integer, got {value!r}", field=field)


# A block size and the Megatron setting it came from (named in errors).
GluBlocks = tuple[int, str]


@dataclass(frozen=True, slots=True)
class MegatronParam:
    """The parameter being mapped, with what is needed to slice it and to blame it."""

    name: str
    tensor: torch.Tensor
    dims: ModelDims
    par: MegatronParallel
    glu: GluInterleave = GluInterleave()

    def error(self, message: str, field: str = "shape") -> LayoutError:
        return LayoutError(
            f"Megatron parameter {message}", tensor=self.name, rank=self.par.rank, field=field
        )

    def expect(self, shape: tuple[int, ...], tensor: torch.Tensor | None = None) -> None:
        got = tuple((self.tensor if tensor is None else tensor).shape)
        if got != shape:
            raise self.error(f"has local shape {list(got)}, expected {list(shape)}")


def whole_slice(p: MegatronParam, hf_name: str, shape: tuple[int, ...]) -> list[HeldSlice]:
    """A parameter every rank of its group holds completely (norms, router)."""
    p.expect(shape)
    return [HeldSlice(hf_name, shape, full_box(shape), p.tensor)]


def row_slice(
    p: MegatronParam, t: torch.Tensor, hf_name: str, full_rows: int, rank: int, size: int
) -> HeldSlice:
    """`t` holds row chunk `rank` of `size` of a tensor with `full_rows` rows."""
    n = t.shape[0]
    if n * size != full_rows:
        raise p.error(f"holds {n} rows x {size} ranks, but {hf_name} has {full_rows} rows")
    tail = tuple(t.shape[1:])
    return HeldSlice(hf_name, (full_rows, *tail), ((rank * n, (rank + 1) * n), *full_box(tail)), t)


def col_slice(
    p: MegatronParam, t: torch.Tensor, hf_name: str, full_cols: int, rank: int, size: int
) -> HeldSlice:
    """Row-parallel: `t` holds column chunk `rank` of `size`."""
    if t.dim() != 2:
        raise p.error(f"is {t.dim()}-d, a row-parallel weight is 2-d")
    out_rows, n = t.shape
    if n * size != full_cols:
        raise p.error(f"holds {n} columns x {size} ranks, but {hf_name} has {full_cols} columns")
    return HeldSlice(hf_name, (out_rows, full_cols), ((0, out_rows), (rank * n, (rank + 1) * n)), t)


def gate_up_slices(
    p: MegatronParam,
    t: torch.Tensor,
    prefix: str,
    kind: str,
    ffn: int,
    rank: int,
    size: int,
    blocks: GluBlocks | None = None,
) -> list[HeldSlice]:
    """`[gate; up]` of one tensor-parallel rank → its gate rows and its up rows.

    With `blocks` (size `k`, setting name) the rank's rows alternate `k` gate rows and `k`
    up rows; each block is its own box, since a strided set of rows is no single view.
    """
    if t.shape[0] % 2:
        raise p.error(f"has {t.shape[0]} rows, not gate and up halves")
    half = t.shape[0] // 2
    if blocks is None:
        return [
            row_slice(p, t[:half], f"{prefix}gate_proj.{kind}", ffn, rank, size),
            row_slice(p, t[half:], f"{prefix}up_proj.{kind}", ffn, rank, size),
        ]
    k, setting = blocks
    if half % k:
        raise p.error(
            f"has {half} gate rows on this rank, not a multiple of {setting}={k}", field=setting
        )
    if half * size != ffn:
        raise p.error(f"holds {half} gate rows x {size} ranks, but the checkpoint has {ffn}")
    tail = tuple(t.shape[1:])
    out: list[HeldSlice] = []
    for j in range(half // k):
        start = rank * half + j * k
        for proj, offset in (("gate_proj", 0), ("up_proj", k)):
            first = 2 * j * k + offset
            out.append(
                HeldSlice(
                    f"{prefix}{proj}.{kind}",
                    (ffn, *tail),
                    ((start, start + k), *full_box(tail)),
                    t[first : first + k],
                )
            )
    return out
