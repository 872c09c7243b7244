"""One Megatron-core parameter → the Hugging Face tensor boxes it holds, as views.

Megatron fuses and pads what the checkpoint keeps apart; every rule below undoes one of
those choices by slicing the local parameter, never by copying it:

- `linear_qkv` is GQA-grouped: per query group `[q heads of the group | k | v]`, and
  tensor parallelism gives each rank whole groups. One box per local group and projection.
- `linear_fc1` is `[gate; up]` per tensor-parallel rank (the rank's gate rows, then its
  up rows), for dense MLPs and experts alike.
- `linear_proj` / `linear_fc2` are row-parallel: the rank holds a column range.
- Embedding and output layer are vocab-parallel over the *padded* vocabulary; the box
  is clipped to the checkpoint's vocabulary and padding rows are not published.
- Experts: `local_experts.{i}.linear_fc*` (SequentialMLP), `linear_fc*.weight{i}`
  (TEGroupedMLP), or GroupedMLP's `weight1` `[H, n*2F]` / `weight2` `[n*F, H]`, which
  Megatron itself reads as `view(n, H, 2F)` / `view(n, F, H)`: expert `i`'s fc1 is
  `weight1.view(n, H, -1)[i].T`, a transposed view.
Expert parameters are sliced by the *expert* tensor-parallel rank and numbered by the
expert-parallel rank, which may form a differently shaped mesh over the same ranks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
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
class _Param:
    """The parameter being mapped, with what is needed to slice it and to blame it."""

    name: str
    tensor: torch.Tensor
    dims: ModelDims
    par: MegatronParallel

    def error(self, message: str, field: str = "shape") -> LayoutError:
        return LayoutError(
            f"Megatron parameter {message}", tensor=self.name, rank=self.par.rank, field=field
        )

    def expect(self, shape: tuple[int, ...], tensor: torch.Tensor | None = None) -> None:
        got = tuple((self.tensor if tensor is None else tensor).shape)
        if got != shape:
            raise self.error(f"has local shape {list(got)}, expected {list(shape)}")


def _whole(p: _Param, hf_name: str, shape: tuple[int, ...]) -> list[HeldSlice]:
    """A parameter every rank of its group holds completely (norms, router)."""
    p.expect(shape)
    return [HeldSlice(hf_name, shape, full_box(shape), p.tensor)]


def _rows(
    p: _Param, t: torch.Tensor, hf_name: str, full_rows: int, rank: int, size: int
) -> HeldSlice:
    """`t` holds row chunk `rank` of `size` of a tensor with `full_rows` rows."""
    n = t.shape[0]
    if n * size != full_rows:
        raise p.error(f"holds {n} rows x {size} ranks, but {hf_name} has {full_rows} rows")
    tail = tuple(t.shape[1:])
    return HeldSlice(hf_name, (full_rows, *tail), ((rank * n, (rank + 1) * n), *full_box(tail)), t)


def _cols(
    p: _Param, t: torch.Tensor, hf_name: str, full_cols: int, rank: int, size: int
) -> HeldSlice:
    """Row-parallel: `t` holds column chunk `rank` of `size`."""
    if t.dim() != 2:
        raise p.error(f"is {t.dim()}-d, a row-parallel weight is 2-d")
    out_rows, n = t.shape
    if n * size != full_cols:
        raise p.error(f"holds {n} columns x {size} ranks, but {hf_name} has {full_cols} columns")
    return HeldSlice(hf_name, (out_rows, full_cols), ((0, out_rows), (rank * n, (rank + 1) * n)), t)


def _gate_up(
    p: _Param, t: torch.Tensor, prefix: str, kind: str, ffn: int, rank: int, size: int
) -> list[HeldSlice]:
    """`[gate; up]` of one tensor-parallel rank → its gate rows and its up rows."""
    if t.shape[0] % 2:
        raise p.error(f"has {t.shape[0]} rows, not gate and up halves")
    half = t.shape[0] // 2
    return [
        _rows(p, t[:half], f"{prefix}gate_proj.{kind}", ffn, rank, size),
        _rows(p, t[half:], f"{prefix}up_proj.{kind}", ffn, rank, size),
    ]


def _qkv(p: _Param, layer: str, kind: str) -> list[HeldSlice]:
    d, par, t = p.dims, p.par, p.tensor
    per_group, hd = d.heads_per_group, d.head_dim
    group_rows = (per_group + 2) * hd
    if d.num_key_value_heads % par.tp_size:
        raise p.error(
            f"splits {d.num_key_value_heads} query groups over {par.tp_size} tensor-parallel "
            "ranks, which Megatron does not do",
            field="parallel",
        )
    local_groups = d.num_key_value_heads // par.tp_size
    tail = tuple(t.shape[1:])
    p.expect((local_groups * group_rows, *tail))
    if kind == "weight" and tail != (d.hidden_size,):
        raise p.error(f"has {list(tail)} input features, expected {d.hidden_size}")
    tail_box = full_box(tail)
    out: list[HeldSlice] = []
    for j in range(local_groups):
        g = par.tp_rank * local_groups + j
        base = j * group_rows
        k0, v0 = base + per_group * hd, base + (per_group + 1) * hd
        q_rows = (g * per_group * hd, (g + 1) * per_group * hd)
        kv_rows = (g * hd, (g + 1) * hd)
        out += [
            HeldSlice(
                f"{layer}self_attn.q_proj.{kind}",
                (d.q_rows, *tail),
                (q_rows, *tail_box),
                t[base:k0],
            ),
            HeldSlice(
                f"{layer}self_attn.k_proj.{kind}",
                (d.kv_rows, *tail),
                (kv_rows, *tail_box),
                t[k0:v0],
            ),
            HeldSlice(
                f"{layer}self_attn.v_proj.{kind}",
                (d.kv_rows, *tail),
                (kv_rows, *tail_box),
                t[v0 : v0 + hd],
            ),
        ]
    return out


def _vocab(p: _Param, hf_name: str) -> list[HeldSlice]:
    """Vocab-parallel rows of the padded vocabulary, clipped to the checkpoint's."""
    d, par, t = p.dims, p.par, p.tensor
    if t.dim() != 2 or t.shape[1] != d.hidden_size:
        raise p.error(f"has shape {list(t.shape)}, expected [vocab/tp, {d.hidden_size}]")
    local = t.shape[0]
    if local * par.tp_size < d.vocab_size:
        raise p.error(
            f"covers a vocabulary of {local * par.tp_size}, smaller than the checkpoint's "
            f"{d.vocab_size}"
        )
    start = par.tp_rank * local
    stop = min(start + local, d.vocab_size)
    if stop <= start:  # this rank holds padding only
        return []
    shape = (d.vocab_size, d.hidden_size)
    return [HeldSlice(hf_name, shape, ((start, stop), (0, d.hidden_size)), t[: stop - start])]


def _global_expert(p: _Param, local_index: int) -> int:
    d, par = p.dims, p.par
    experts = d.num_experts
    if experts == 0 or experts % par.ep_size:
        raise p.error(
            f"is an expert, but {experts} experts do not split over {par.ep_size} "
            "expert-parallel ranks",
            field="parallel",
        )
    per_rank = experts // par.ep_size
    if not 0 <= local_index < per_rank:
        raise p.error(f"names local expert {local_index}, but each rank holds {per_rank}")
    return par.ep_rank * per_rank + local_index


def _expert_fc(
    p: _Param, layer: str, local_index: int, fc: int, t: torch.Tensor
) -> list[HeldSlice]:
    d, par = p.dims, p.par
    ffn = d.expert_ffn(tensor=p.name)
    prefix = f"{layer}mlp.experts.{_global_expert(p, local_index)}."
    if t.dim() != 2:
        raise p.error(f"is {t.dim()}-d, an expert weight is 2-d")
    if fc == 1:
        if t.shape[1] != d.hidden_size:
            raise p.error(f"has {t.shape[1]} input features, expected {d.hidden_size}")
        return _gate_up(p, t, prefix, "weight", ffn, par.etp_rank, par.etp_size)
    if t.shape[0] != d.hidden_size:
        raise p.error(f"has {t.shape[0]} output features, expected {d.hidden_size}")
    return [_cols(p, t, f"{prefix}down_proj.weight", ffn, par.etp_rank, par.etp_size)]


def _grouped_experts(p: _Param, layer: str, fc: int) -> list[HeldSlice]:
    """GroupedMLP's `weight1` / `weight2`, read the way Megatron's forward reads them."""
    d, par, t = p.dims, p.par, p.tensor
    per_rank = d.num_experts // par.ep_size if d.num_experts % par.ep_size == 0 else 0
    if per_rank == 0 or t.dim() != 2 or t.numel() % (per_rank * d.hidden_size):
        raise p.error(
            f"has shape {list(t.shape)}, not {per_rank or '?'} experts of width {d.hidden_size}"
        )
    try:
        experts = (
            t.view(per_rank, d.hidden_size, -1) if fc == 1 else t.view(per_rank, -1, d.hidden_size)
        )
    except RuntimeError as exc:  # only a non-contiguous parameter cannot be viewed
        raise p.error(f"cannot be viewed per expert: {exc}") from exc
    out: list[HeldSlice] = []
    for i in range(per_rank):
        out += _expert_fc(p, layer, i, fc, experts[i].t())
    return out


Rule = Callable[[_Param, str], list[HeldSlice]]


def _hidden_vector(hf_suffix: str) -> Rule:
    return lambda p, layer: _whole(p, layer + hf_suffix, (p.dims.hidden_size,))


def _head_vector(hf_suffix: str) -> Rule:
    return lambda p, layer: _whole(p, layer + hf_suffix, (p.dims.head_dim,))


def _dense_fc1(kind: str) -> Rule:
    def rule(p: _Param, layer: str) -> list[HeldSlice]:
        ffn = p.dims.dense_ffn(tensor=p.name)
        if kind == "weight" and (p.tensor.dim() != 2 or p.tensor.shape[1] != p.dims.hidden_size):
            raise p.error(f"has shape {list(p.tensor.shape)}, expected [2*ffn/tp, hidden]")
        return _gate_up(p, p.tensor, f"{layer}mlp.", kind, ffn, p.par.tp_rank, p.par.tp_size)

    return rule


def _row_parallel(hf_suffix: str, full_cols: Callable[[_Param], int]) -> Rule:
    def rule(p: _Param, layer: str) -> list[HeldSlice]:
        if p.tensor.dim() != 2 or p.tensor.shape[0] != p.dims.hidden_size:
            raise p.error(f"has shape {list(p.tensor.shape)}, expected [hidden, in/tp]")
        return [_cols(p, p.tensor, layer + hf_suffix, full_cols(p), p.par.tp_rank, p.par.tp_size)]

    return rule


# Per-layer parameter names (after `decoder.layers.N.`). Norm names cover both the local
# spec (`input_layernorm`, `pre_mlp_layernorm`) and Transformer Engine's fused
# `linear_qkv.layer_norm_*` / `linear_fc1.layer_norm_*`.
_LAYER_RULES: dict[str, Rule] = {
    "input_layernorm.weight": _hidden_vector("input_layernorm.weight"),
    "input_layernorm.bias": _hidden_vector("input_layernorm.bias"),
    "self_attention.linear_qkv.layer_norm_weight": _hidden_vector("input_layernorm.weight"),
    "self_attention.linear_qkv.layer_norm_bias": _hidden_vector("input_layernorm.bias"),
    "pre_mlp_layernorm.weight": _hidden_vector("post_attention_layernorm.weight"),
    "pre_mlp_layernorm.bias": _hidden_vector("post_attention_layernorm.bias"),
    "mlp.linear_fc1.layer_norm_weight": _hidden_vector("post_attention_layernorm.weight"),
    "mlp.linear_fc1.layer_norm_bias": _hidden_vector("post_attention_layernorm.bias"),
    "self_attention.q_layernorm.weight": _head_vector("self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": _head_vector("self_attn.k_norm.weight"),
    "self_attention.linear_qkv.weight": lambda p, layer: _qkv(p, layer, "weight"),
    "self_attention.linear_qkv.bias": lambda p, layer: _qkv(p, layer, "bias"),
    "self_attention.linear_proj.weight": _row_parallel(
        "self_attn.o_proj.weight", lambda p: p.dims.q_rows
    ),
    "self_attention.linear_proj.bias": _hidden_vector("self_attn.o_proj.bias"),
    "mlp.linear_fc1.weight": _dense_fc1("weight"),
    "mlp.linear_fc1.bias": _dense_fc1("bias"),
    "mlp.linear_fc2.weight": _row_parallel(
        "mlp.down_proj.weight", lambda p: p.dims.dense_ffn(tensor=p.name)
    ),
    "mlp.linear_fc2.bias": _hidden_vector("mlp.down_proj.bias"),
    "mlp.router.weight": lambda p, layer: _whole(
        p, f"{layer}mlp.gate.weight", (p.dims.num_experts, p.dims.hidden_size)
    ),
    "mlp.experts.weight1": lambda p, layer: _grouped_experts(p, layer, 1),
    "mlp.experts.weight2": lambda p, layer: _grouped_experts(p, layer, 2),
}

# SequentialMLP and TEGroupedMLP experts (`{i}` is the local expert index).
_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<seq>\d+)\.linear_fc(?P<seq_fc>[12])\.weight"
    r"|linear_fc(?P<te_fc>[12])\.weight(?P<te>\d+))$"
)
_LAYER = re.compile(r"^decoder\.layers\.(?P<index>\d+)\.(?P<rest>.+)$")


def _layer_slices(p: _Param, layer: str, suffix: str) -> list[HeldSlice]:
    rule = _LAYER_RULES.get(suffix)
    if rule is not None:
        return rule(p, layer)
    m = _EXPERT.match(suffix)
    if m is not None:
        local = int(m["seq"] if m["seq"] is not None else m["te"])
        fc = int(m["seq_fc"] or m["te_fc"])
        return _expert_fc(p, layer, local, fc, p.tensor)
    raise p.error("has no Hugging Face counterpart this adapter knows", field="name")


def megatron_param_slices(
    name: str,
    tensor: torch.Tensor,
    *,
    dims: ModelDims,
    parallel: MegatronParallel,
    layer_numbers: Mapping[int, int],
    tied_output: bool,
) -> list[HeldSlice]:
    """The Hugging Face boxes one Megatron parameter holds on this rank, as views.

    `layer_numbers` maps the local layer index in `decoder.layers.N` to the global,
    0-based layer index (pipeline and virtual-pipeline offsets included).
    `tied_output`: the output layer shares the word embeddings (Megatron's
    `share_embeddings_and_output_weights`), so a last-stage copy publishes the
    embedding's boxes.
    """
    p = _Param(name, tensor, dims, parallel)
    if name == "embedding.word_embeddings.weight":
        return _vocab(p, "model.embed_tokens.weight")
    if name == "output_layer.weight":
        return _vocab(p, "model.embed_tokens.weight" if tied_output else "lm_head.weight")
    if name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        return _whole(p, "model.norm." + name.rsplit(".", 1)[1], (dims.hidden_size,))
    m = _LAYER.match(name)
    if m is None:
        raise p.error("has no Hugging Face counterpart this adapter knows", field="name")
    index = int(m["index"])
    if index not in layer_numbers:
        raise p.error(f"is in local layer {index}, which the model's decoder does not list")
    return _layer_slices(p, f"model.layers.{layer_numbers[index]}.", m["rest"])
