"""One Megatron-core parameter → the Hugging Face tensor boxes it holds, as views.

Megatron fuses and pads what the checkpoint keeps apart; every rule below undoes one of
those choices by slicing the local parameter, never by copying it:

- `linear_qkv` is GQA-grouped: per query group `[q heads of the group | k | v]`, and
  tensor parallelism gives each rank whole groups. One box per local group and projection.
- `linear_fc1` is `[gate; up]` per tensor-parallel rank (the rank's gate rows, then its
  up rows), for dense MLPs, shared experts and experts alike; with Megatron's GLU
  interleaving it is `[gate 0:k; up 0:k; gate k:2k; up k:2k; ...]` instead, one box per
  block of `k` rows.
- `linear_proj` / `linear_fc2` are row-parallel: the rank holds a column range.
- Embedding and output layer are vocab-parallel over the *padded* vocabulary; the box
  is clipped to the checkpoint's vocabulary and padding rows are not published.
- Multi-latent attention (DeepSeek-V2/V3, Kimi-K2) keeps the checkpoint's projections
  one to one (Megatron-Bridge maps each with a plain AutoMapping, no permutation:
  src/megatron/bridge/models/deepseek/common.py); the up-projections and `q_proj` are
  column-parallel over heads, `linear_proj` row-parallel over heads x v_head_dim, and the
  down-projections either replicated (Transformer Engine spec: `TELinear`,
  `parallel_mode="duplicated"`) or column-parallel (local spec: `ColumnParallelLinear`),
  which the local row count tells apart (megatron/core/transformer/multi_latent_attention.py,
  megatron/core/models/gpt/gpt_layer_specs.py).
- Experts: `local_experts.{i}.linear_fc*` (SequentialMLP), `linear_fc*.weight{i}`
  (TEGroupedMLP), TE's single grouped `linear_fc*.weight` `[n, out, in]` (or its
  `[n*out, in]` logical form), or GroupedMLP's `weight1` `[H, n*2F]` / `weight2`
  `[n*F, H]`, which Megatron itself reads as `view(n, H, 2F)` / `view(n, F, H)`: expert
  `i`'s fc1 is `weight1.view(n, H, -1)[i].T`, a transposed view.
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
from refitplane.trainer.layouts.dims import MlaDims, ModelDims
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
_Blocks = tuple[int, str]


@dataclass(frozen=True, slots=True)
class _Param:
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
    p: _Param,
    t: torch.Tensor,
    prefix: str,
    kind: str,
    ffn: int,
    rank: int,
    size: int,
    blocks: _Blocks | None = None,
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
            _rows(p, t[:half], f"{prefix}gate_proj.{kind}", ffn, rank, size),
            _rows(p, t[half:], f"{prefix}up_proj.{kind}", ffn, rank, size),
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


def _qkv(p: _Param, layer: str, kind: str) -> list[HeldSlice]:
    d, par, t = p.dims, p.par, p.tensor
    _not_mla(p)
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


def _experts_per_rank(p: _Param) -> int:
    experts, ep = p.dims.num_experts, p.par.ep_size
    if experts == 0 or experts % ep:
        raise p.error(
            f"is an expert, but {experts} experts do not split over {ep} expert-parallel ranks",
            field="parallel",
        )
    return experts // ep


def _global_expert(p: _Param, local_index: int) -> int:
    per_rank = _experts_per_rank(p)
    if not 0 <= local_index < per_rank:
        raise p.error(f"names local expert {local_index}, but each rank holds {per_rank}")
    return p.par.ep_rank * per_rank + local_index


def _expert_blocks(p: _Param, fc: int, storage: str | None) -> _Blocks | None:
    """The routed experts' GLU blocks for fc1 of a storage whose forward reads them.

    Only TEGroupedMLP de-interleaves (`storage` None). SequentialMLP and the legacy
    GroupedMLP compute `[gate; up]`, so with the setting on, what their memory holds
    depends on who loaded it: refused rather than guessed.
    """
    k = p.glu.experts
    if fc != 1 or k is None:
        return None
    if storage is not None:
        raise p.error(
            f"is a {storage} fc1, whose forward reads [gate; up], but the model sets "
            f"moe_mlp_glu_interleave_size={k}; which layout its memory holds is unknown",
            field="moe_mlp_glu_interleave_size",
        )
    return (k, "moe_mlp_glu_interleave_size")


def _expert_fc(
    p: _Param,
    layer: str,
    local_index: int,
    fc: int,
    t: torch.Tensor,
    blocks: _Blocks | None = None,
) -> list[HeldSlice]:
    d, par = p.dims, p.par
    ffn = d.expert_ffn(tensor=p.name)
    prefix = f"{layer}mlp.experts.{_global_expert(p, local_index)}."
    if t.dim() != 2:
        raise p.error(f"is {t.dim()}-d, an expert weight is 2-d")
    if fc == 1:
        if t.shape[1] != d.hidden_size:
            raise p.error(f"has {t.shape[1]} input features, expected {d.hidden_size}")
        return _gate_up(p, t, prefix, "weight", ffn, par.etp_rank, par.etp_size, blocks)
    if t.shape[0] != d.hidden_size:
        raise p.error(f"has {t.shape[0]} output features, expected {d.hidden_size}")
    return [_cols(p, t, f"{prefix}down_proj.weight", ffn, par.etp_rank, par.etp_size)]


def _grouped_experts(p: _Param, layer: str, fc: int) -> list[HeldSlice]:
    """GroupedMLP's `weight1` / `weight2`, read the way Megatron's forward reads them."""
    d, par, t = p.dims, p.par, p.tensor
    _expert_blocks(p, fc, "legacy GroupedMLP")
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


def _grouped_tensor_data(p: _Param) -> torch.Tensor:
    """The plain tensor behind a Transformer Engine `GroupedTensor` parameter (else `t`).

    With `moe_single_grouped_weight` TE's GroupedLinear registers one `weight` that is a
    `GroupedTensor` wrapper subclass of shape `[n, out, in]`
    (transformer_engine/pytorch/tensor/grouped_tensor.py). It refuses slicing, but answers
    `view(-1)` with its backing `rowwise_data` (the path Megatron's distributed optimizer
    flattens it by), so the experts are views of that buffer. With FP8/FP4 primary
    weights (`quantizer` set) the buffer holds quantized bytes, not the checkpoint's values.
    """
    t = p.tensor
    if not hasattr(t, "rowwise_data"):
        return t
    if getattr(t, "quantizer", None) is not None:
        raise p.error(
            "is a quantized Transformer Engine GroupedTensor (moe_single_grouped_weight with "
            "FP8/FP4 primary weights); its storage holds quantized data, not the weights",
            field="moe_single_grouped_weight",
        )
    shape = tuple(t.shape)
    flat = t.view(-1)
    if hasattr(flat, "rowwise_data") or flat.numel() != t.numel():
        raise p.error(
            "is a GroupedTensor whose view(-1) is not its plain backing buffer",
            field="moe_single_grouped_weight",
        )
    return flat.view(shape)


def _single_grouped_experts(p: _Param, layer: str, fc: int) -> list[HeldSlice]:
    """TE GroupedLinear's single grouped `weight`: every local expert's weight, stacked.

    TE stacks the per-GEMM weights on a new first dimension
    (GroupedLinear._remap_grouped_weight_state_dict_keys: `torch.stack(weight0..N)`), so
    expert `i` is `weight[i]`; the `[n*out, in]` logical form is read as `view(n, out, in)`.
    """
    per_rank = _experts_per_rank(p)
    t = _grouped_tensor_data(p)
    if t.dim() == 2 and t.shape[0] % per_rank == 0:
        try:
            t = t.view(per_rank, -1, t.shape[1])
        except RuntimeError as exc:
            raise p.error(f"cannot be viewed per expert: {exc}") from exc
    if t.dim() != 3 or t.shape[0] != per_rank:
        raise p.error(
            f"has shape {list(p.tensor.shape)}, not [{per_rank}, out, in] or "
            f"[{per_rank}*out, in] for {per_rank} local experts"
        )
    blocks = _expert_blocks(p, fc, None)
    out: list[HeldSlice] = []
    for i in range(per_rank):
        out += _expert_fc(p, layer, i, fc, t[i], blocks)
    return out


def _shared_fc1(p: _Param, layer: str) -> list[HeldSlice]:
    """Shared experts are one MLP on the dense tensor-parallel group (SharedExpertMLP)."""
    d = p.dims
    ffn = d.shared_ffn(tensor=p.name)
    t = p.tensor
    if t.dim() != 2 or t.shape[1] != d.hidden_size:
        raise p.error(f"has shape {list(t.shape)}, expected [2*shared_ffn/tp, {d.hidden_size}]")
    k = p.glu.shared_experts
    blocks = None if k is None else (k, "moe_shared_expert_glu_interleave_size")
    prefix = layer + d.shared_expert_prefix
    return _gate_up(p, t, prefix, "weight", ffn, p.par.tp_rank, p.par.tp_size, blocks)


def _shared_fc2(p: _Param, layer: str) -> list[HeldSlice]:
    d, t = p.dims, p.tensor
    ffn = d.shared_ffn(tensor=p.name)
    if t.dim() != 2 or t.shape[0] != d.hidden_size:
        raise p.error(f"has shape {list(t.shape)}, expected [{d.hidden_size}, shared_ffn/tp]")
    name = f"{layer}{d.shared_expert_prefix}down_proj.weight"
    return [_cols(p, t, name, ffn, p.par.tp_rank, p.par.tp_size)]


def _shared_gate(p: _Param, layer: str) -> list[HeldSlice]:
    """`shared_experts.gate_weight` [1, hidden]: Qwen2-MoE's `shared_expert_gate`."""
    d = p.dims
    d.shared_ffn(tensor=p.name)
    if d.shared_expert_prefix != "mlp.shared_expert.":
        raise p.error(
            "is a shared-expert gate, which a checkpoint naming its experts "
            f"{d.shared_expert_prefix!r} (DeepSeek) does not have",
            field="name",
        )
    return _whole(p, f"{layer}mlp.shared_expert_gate.weight", (1, d.hidden_size))


# ---- multi-latent attention -------------------------------------------------------------


def _not_mla(p: _Param) -> None:
    if p.dims.is_mla:
        raise p.error(
            f"belongs to grouped-query attention, but the checkpoint is multi-latent "
            f"attention (kv_lora_rank={p.dims.kv_lora_rank})",
            field="kv_lora_rank",
        )


def _mla(p: _Param) -> MlaDims:
    m = p.dims.mla
    if m is None:
        raise p.error(
            "is a multi-latent attention weight, but the checkpoint has no kv_lora_rank",
            field="kv_lora_rank",
        )
    return m


def _q_lora_rank(p: _Param, m: MlaDims) -> int:
    """`linear_q_down/up_proj` and `q_layernorm` exist only with a query LoRA rank."""
    if m.q_lora_rank is None:
        raise p.error(
            "is a low-rank query weight, but the checkpoint has q_lora_rank=None "
            "(its queries are one q_proj)",
            field="q_lora_rank",
        )
    return m.q_lora_rank


def _rotary_rows(p: _Param) -> None:
    """Rows that include rotary dims are published as they are: both Megatron
    (`_apply_rotary_pos_emb_bshd` with multi_latent_attention: `t[..., 0::2]`,
    `t[..., 1::2]`) and the checkpoint (DeepSeek's interleaved pairs, transformers'
    `rope_interleave=True`) rotate interleaved pairs. A checkpoint keeping them in halves
    would need those rows permuted."""
    if not p.dims.rope_interleave:
        raise p.error(
            "holds rotary rows, which Megatron's MLA rotates as interleaved pairs, but the "
            "checkpoint has rope_interleave=False (halves); not mapped",
            field="rope_interleave",
        )


def _mla_2d(p: _Param, in_features: int) -> torch.Tensor:
    t = p.tensor
    if t.dim() != 2 or t.shape[1] != in_features:
        raise p.error(f"has shape {list(t.shape)}, expected [rows, {in_features}]")
    return t


def _mla_heads(p: _Param, hf_name: str, per_head: int, in_features: int) -> list[HeldSlice]:
    """Column-parallel over heads: rank `r` holds heads `[r*n/tp, (r+1)*n/tp)`, each head's
    rows contiguous, so its local rows are one row range of the checkpoint tensor."""
    m, par = _mla(p), p.par
    if m.heads % par.tp_size:
        raise p.error(
            f"splits {m.heads} heads over {par.tp_size} tensor-parallel ranks, which Megatron "
            "does not do",
            field="parallel",
        )
    t = _mla_2d(p, in_features)
    return [_rows(p, t, hf_name, m.heads * per_head, par.tp_rank, par.tp_size)]


def _mla_down(p: _Param, hf_name: str, full_rows: int) -> list[HeldSlice]:
    """`linear_q_down_proj` / `linear_kv_down_proj`: whole when replicated (TE spec's
    duplicated TELinear), a row range when column-parallel (local spec)."""
    t = _mla_2d(p, p.dims.hidden_size)
    if t.shape[0] == full_rows:
        shape = (full_rows, p.dims.hidden_size)
        return [HeldSlice(hf_name, shape, full_box(shape), t)]
    return [_rows(p, t, hf_name, full_rows, p.par.tp_rank, p.par.tp_size)]


def _q_proj(p: _Param, layer: str) -> list[HeldSlice]:
    """`linear_q_proj` (q_lora_rank None, DeepSeek-V2-Lite): per head `[nope; rope]`."""
    m = _mla(p)
    if m.q_lora_rank is not None:
        raise p.error(
            f"is a single query projection, but the checkpoint has q_lora_rank="
            f"{m.q_lora_rank} (q_a_proj / q_b_proj)",
            field="q_lora_rank",
        )
    _rotary_rows(p)
    return _mla_heads(p, f"{layer}self_attn.q_proj.weight", m.q_head_dim, p.dims.hidden_size)


def _q_down(p: _Param, layer: str) -> list[HeldSlice]:
    m = _mla(p)
    return _mla_down(p, f"{layer}self_attn.q_a_proj.weight", _q_lora_rank(p, m))


def _q_up(p: _Param, layer: str) -> list[HeldSlice]:
    m = _mla(p)
    rank = _q_lora_rank(p, m)
    _rotary_rows(p)
    return _mla_heads(p, f"{layer}self_attn.q_b_proj.weight", m.q_head_dim, rank)


def _q_norm(p: _Param, layer: str) -> list[HeldSlice]:
    return _whole(p, f"{layer}self_attn.q_a_layernorm.weight", (_q_lora_rank(p, _mla(p)),))


def _kv_down(p: _Param, layer: str) -> list[HeldSlice]:
    """`kv_a_proj_with_mqa` rows are `[compressed kv (kv_lora_rank); rotary key
    (qk_rope_head_dim)]` in both: Megatron splits its output `[kv_lora_rank,
    qk_pos_emb_head_dim]` in that order, as transformers' DeepSeek-V3 does."""
    m = _mla(p)
    _rotary_rows(p)
    return _mla_down(p, f"{layer}self_attn.kv_a_proj_with_mqa.weight", m.kv_a_rows)


def _kv_up(p: _Param, layer: str) -> list[HeldSlice]:
    """Per head `[no-position key; value]` in both (Megatron views its output as
    `[n, qk_head_dim + v_head_dim]` and splits it in that order)."""
    m = _mla(p)
    name = f"{layer}self_attn.kv_b_proj.weight"
    return _mla_heads(p, name, m.kv_b_head_rows, m.kv_lora_rank)


def _kv_norm(p: _Param, layer: str) -> list[HeldSlice]:
    return _whole(p, f"{layer}self_attn.kv_a_layernorm.weight", (_mla(p).kv_lora_rank,))


Rule = Callable[[_Param, str], list[HeldSlice]]


def _hidden_vector(hf_suffix: str) -> Rule:
    return lambda p, layer: _whole(p, layer + hf_suffix, (p.dims.hidden_size,))


def _head_vector(hf_suffix: str) -> Rule:
    def rule(p: _Param, layer: str) -> list[HeldSlice]:
        _not_mla(p)
        return _whole(p, layer + hf_suffix, (p.dims.head_dim,))

    return rule


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
        "self_attn.o_proj.weight", lambda p: p.dims.attention_out_features
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
    # A buffer, not a parameter (TopKRouter, moe_router_enable_expert_bias), float32;
    # Megatron-Bridge: deepseek_v3_bridge.py maps it to the gate's correction bias.
    "mlp.router.expert_bias": lambda p, layer: _whole(
        p, f"{layer}mlp.gate.e_score_correction_bias", (p.dims.num_experts,)
    ),
    "mlp.experts.weight1": lambda p, layer: _grouped_experts(p, layer, 1),
    "mlp.experts.weight2": lambda p, layer: _grouped_experts(p, layer, 2),
    "mlp.experts.linear_fc1.weight": lambda p, layer: _single_grouped_experts(p, layer, 1),
    "mlp.experts.linear_fc2.weight": lambda p, layer: _single_grouped_experts(p, layer, 2),
    "mlp.shared_experts.linear_fc1.weight": _shared_fc1,
    "mlp.shared_experts.linear_fc2.weight": _shared_fc2,
    "mlp.shared_experts.gate_weight": _shared_gate,
}

# Multi-latent attention (after `decoder.layers.N.`). `q_layernorm` is also a GQA name
# (per-head q_norm); which one applies is the checkpoint's choice (`ModelDims.is_mla`).
# The `*.layer_norm_weight` names are Transformer Engine's fused norms
# (Megatron-Bridge src/megatron/bridge/models/deepseek/common.py lists both spellings).
_MLA_RULES: dict[str, Rule] = {
    "self_attention.linear_q_proj.weight": _q_proj,
    "self_attention.linear_q_proj.layer_norm_weight": _hidden_vector("input_layernorm.weight"),
    "self_attention.linear_q_down_proj.weight": _q_down,
    "self_attention.linear_q_up_proj.weight": _q_up,
    "self_attention.linear_q_up_proj.layer_norm_weight": _q_norm,
    "self_attention.q_layernorm.weight": _q_norm,
    "self_attention.linear_kv_down_proj.weight": _kv_down,
    "self_attention.linear_kv_up_proj.weight": _kv_up,
    "self_attention.linear_kv_up_proj.layer_norm_weight": _kv_norm,
    "self_attention.kv_layernorm.weight": _kv_norm,
}

# Per-layer names that only a MoE layer has: a checkpoint layer below
# first_k_dense_replace is dense, so one of these there is a moe_layer_freq mismatch.
_MOE_PARTS = ("mlp.router.", "mlp.experts.", "mlp.shared_experts.")

# SequentialMLP and TEGroupedMLP experts (`{i}` is the local expert index).
_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<seq>\d+)\.linear_fc(?P<seq_fc>[12])\.weight"
    r"|linear_fc(?P<te_fc>[12])\.weight(?P<te>\d+))$"
)
_LAYER = re.compile(r"^decoder\.layers\.(?P<index>\d+)\.(?P<rest>.+)$")


def _layer_slices(p: _Param, number: int, suffix: str) -> list[HeldSlice]:
    layer = f"model.layers.{number}."
    if suffix.startswith(_MOE_PARTS) and number < p.dims.first_k_dense_replace:
        raise p.error(
            f"is a MoE weight of layer {number}, but the checkpoint's first "
            f"{p.dims.first_k_dense_replace} layers are dense (first_k_dense_replace)",
            field="first_k_dense_replace",
        )
    rule = _MLA_RULES.get(suffix) if p.dims.is_mla else None
    rule = rule or _LAYER_RULES.get(suffix) or _MLA_RULES.get(suffix)
    if rule is not None:
        return rule(p, layer)
    m = _EXPERT.match(suffix)
    if m is not None:
        if m["seq"] is not None:
            fc = int(m["seq_fc"])
            blocks = _expert_blocks(p, fc, "SequentialMLP")
            return _expert_fc(p, layer, int(m["seq"]), fc, p.tensor, blocks)
        fc = int(m["te_fc"])
        return _expert_fc(p, layer, int(m["te"]), fc, p.tensor, _expert_blocks(p, fc, None))
    raise p.error("has no Hugging Face counterpart this adapter knows", field="name")


def megatron_param_slices(
    name: str,
    tensor: torch.Tensor,
    *,
    dims: ModelDims,
    parallel: MegatronParallel,
    layer_numbers: Mapping[int, int],
    tied_output: bool,
    glu_interleave: GluInterleave | None = None,
) -> list[HeldSlice]:
    """The Hugging Face boxes one Megatron parameter holds on this rank, as views.

    `layer_numbers` maps the local layer index in `decoder.layers.N` to the global,
    0-based layer index (pipeline and virtual-pipeline offsets included).
    `tied_output`: the output layer shares the word embeddings (Megatron's
    `share_embeddings_and_output_weights`), so a last-stage copy publishes the
    embedding's boxes. `glu_interleave`: the model's GLU interleaving settings, which
    the shapes do not show (default: none).
    """
    p = _Param(name, tensor, dims, parallel, glu_interleave or GluInterleave())
    try:
        return _slices(p, layer_numbers, tied_output)
    except LayoutError as exc:
        if exc.rank is not None:
            raise
        # ModelDims knows the tensor and the field, not which rank asked.
        raise exc.with_rank(parallel.rank) from exc


def _slices(p: _Param, layer_numbers: Mapping[int, int], tied_output: bool) -> list[HeldSlice]:
    name, dims = p.name, p.dims
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
    return _layer_slices(p, layer_numbers[index], m["rest"])
