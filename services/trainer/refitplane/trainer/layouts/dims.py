"""The few model dimensions a layout adapter needs to name and size Hugging Face tensors.

Megatron pads the vocabulary and fuses Q/K/V and gate/up; the Hugging Face checkpoint does
neither. The adapter needs the *checkpoint's* sizes to know where the padding starts and
how a fused row range splits, so they come from the Hugging Face config (or are given
explicitly), never from the trainer's padded shapes.

Multi-latent attention (DeepSeek-V2/V3, Kimi-K2) replaces Q/K/V by low-rank projections
whose sizes (`q_lora_rank`, `kv_lora_rank`, the per-head `qk_nope_head_dim`,
`qk_rope_head_dim`, `v_head_dim`) are what name and split them; `kv_lora_rank` being set
is what makes a checkpoint MLA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refitplane.errors import LayoutError


def _positive(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{field} must be a positive integer, got {value!r}", field=field)
    return value


# How the checkpoint names a MoE layer's always-on experts: DeepSeek-V2/V3 and Kimi-K2 say
# `mlp.shared_experts.{gate,up,down}_proj` (plural, no gate); Qwen2-MoE says
# `mlp.shared_expert.*` and gates it with `mlp.shared_expert_gate.weight` [1, hidden].
SHARED_EXPERT_PREFIXES = ("mlp.shared_experts.", "mlp.shared_expert.")
_MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True, slots=True)
class ModelDims:
    """Checkpoint-side sizes of a decoder-only transformer (Llama / Qwen2 / Qwen3 family)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int | None = None
    moe_intermediate_size: int | None = None
    num_experts: int = 0
    tie_word_embeddings: bool = False
    # Multi-latent attention; None for GQA checkpoints. q_lora_rank stays None for MLA
    # checkpoints that project queries in one step (DeepSeek-V2-Lite: `q_proj`).
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # False only for a DeepSeek-V3 config that keeps the rope dimensions in halves
    # (`rope_interleave=False`); Megatron's MLA always reads them as interleaved pairs.
    rope_interleave: bool = True
    # Shared experts: their gate/up width (DeepSeek: moe_intermediate_size x
    # n_shared_experts) and the checkpoint's name for them (SHARED_EXPERT_PREFIXES).
    shared_expert_intermediate_size: int | None = None
    shared_expert_prefix: str = SHARED_EXPERT_PREFIXES[0]
    # Layers [0, first_k_dense_replace) have a dense MLP (DeepSeek); a router or expert
    # there means the Megatron model's moe_layer_freq disagrees with the checkpoint.
    first_k_dense_replace: int = 0

    def __post_init__(self) -> None:
        _positive(self.hidden_size, "hidden_size")
        _positive(self.num_attention_heads, "num_attention_heads")
        _positive(self.num_key_value_heads, "num_key_value_heads")
        _positive(self.head_dim, "head_dim")
        _positive(self.vocab_size, "vocab_size")
        if self.intermediate_size is not None:
            _positive(self.intermediate_size, "intermediate_size")
        if self.moe_intermediate_size is not None:
            _positive(self.moe_intermediate_size, "moe_intermediate_size")
        if self.num_experts < 0:
            raise LayoutError("num_experts must be >= 0", field="num_experts")
        if self.num_attention_heads % self.num_key_value_heads:
            raise LayoutError(
                f"{self.num_attention_heads} attention heads do not split into "
                f"{self.num_key_value_heads} key/value groups",
                field="num_key_value_heads",
            )
        for field in ("q_lora_rank", *_MLA_FIELDS, "shared_expert_intermediate_size"):
            value = getattr(self, field)
            if value is not None:
                _positive(value, field)
        given = [f for f in _MLA_FIELDS if getattr(self, f) is not None]
        if given and len(given) != len(_MLA_FIELDS):
            missing = sorted(set(_MLA_FIELDS) - set(given))
            raise LayoutError(
                f"multi-latent attention needs {', '.join(_MLA_FIELDS)}; missing {missing}",
                field=missing[0],
            )
        if self.q_lora_rank is not None and not given:
            raise LayoutError(
                "q_lora_rank is set but kv_lora_rank is not (not an MLA checkpoint)",
                field="kv_lora_rank",
            )
        if self.shared_expert_prefix not in SHARED_EXPERT_PREFIXES:
            raise LayoutError(
                f"shared_expert_prefix {self.shared_expert_prefix!r} is not one of "
                f"{list(SHARED_EXPERT_PREFIXES)}",
                field="shared_expert_prefix",
            )
        if self.first_k_dense_replace < 0:
            raise LayoutError("first_k_dense_replace must be >= 0", field="first_k_dense_replace")

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_rows(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def mla(self) -> MlaDims | None:
        """The MLA sizes, all present, or None for a GQA checkpoint."""
        if (
            self.kv_lora_rank is None
            or self.qk_nope_head_dim is None
            or self.qk_rope_head_dim is None
            or self.v_head_dim is None
        ):
            return None
        return MlaDims(
            heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
        )

    @property
    def attention_out_features(self) -> int:
        """Columns of `o_proj`: heads x head_dim for GQA, heads x v_head_dim for MLA."""
        if self.v_head_dim is not None:
            return self.num_attention_heads * self.v_head_dim
        return self.q_rows

    def shared_ffn(self, *, tensor: str) -> int:
        if self.shared_expert_intermediate_size is None:
            raise LayoutError(
                "shared expert found but the checkpoint has no shared experts "
                "(n_shared_experts / shared_expert_intermediate_size)",
                tensor=tensor,
                field="shared_expert_intermediate_size",
            )
        return self.shared_expert_intermediate_size

    def dense_ffn(self, *, tensor: str) -> int:
        if self.intermediate_size is None:
            raise LayoutError("dense MLP found but intermediate_size is unknown", tensor=tensor)
        return self.intermediate_size

    def expert_ffn(self, *, tensor: str) -> int:
        if self.moe_intermediate_size is None or self.num_experts == 0:
            raise LayoutError(
                "MoE expert found but num_experts / moe_intermediate_size are unknown",
                tensor=tensor,
            )
        return self.moe_intermediate_size

    @staticmethod
    def from_hf_config(config: Any) -> ModelDims:
        """Read a `transformers` config (Qwen3, Qwen3-MoE, Qwen2, Llama, DeepSeek-V2/V3,
        Kimi-K2, ...), duck-typed."""

        def get(name: str, default: Any = None) -> Any:
            return getattr(config, name, default)

        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        head_dim = get("head_dim")
        if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads:
            head_dim = hidden // heads
        num_experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts") or 0
        moe_ffn = get("moe_intermediate_size") if num_experts else None
        # DeepSeek: n_shared_experts experts of moe_intermediate_size, fused into one MLP
        # (Megatron-Bridge: moe_shared_expert_intermediate_size = moe_intermediate_size *
        # n_shared_experts); Qwen2-MoE: one shared expert of shared_expert_intermediate_size.
        n_shared = get("n_shared_experts")
        shared_ffn, shared_prefix = None, SHARED_EXPERT_PREFIXES[0]
        if num_experts and isinstance(n_shared, int) and n_shared and isinstance(moe_ffn, int):
            shared_ffn = moe_ffn * n_shared
        elif num_experts and get("shared_expert_intermediate_size"):
            shared_ffn, shared_prefix = get("shared_expert_intermediate_size"), "mlp.shared_expert."
        mla = get("kv_lora_rank") is not None
        return ModelDims(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            head_dim=head_dim,
            vocab_size=get("vocab_size"),
            intermediate_size=get("intermediate_size"),
            moe_intermediate_size=moe_ffn,
            num_experts=int(num_experts),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            q_lora_rank=get("q_lora_rank") if mla else None,
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim") if mla else None,
            qk_rope_head_dim=get("qk_rope_head_dim") if mla else None,
            v_head_dim=get("v_head_dim") if mla else None,
            # DeepSeek-V2's config has no such field and always rotates interleaved pairs.
            rope_interleave=get("rope_interleave") is not False,
            shared_expert_intermediate_size=shared_ffn,
            shared_expert_prefix=shared_prefix,
            first_k_dense_replace=int(get("first_k_dense_replace") or 0) if num_experts else 0,
        )


@dataclass(frozen=True, slots=True)
class MlaDims:
    """The sizes of one MLA layer, all known (see `ModelDims.mla`)."""

    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def q_head_dim(self) -> int:
        """Per-head query width: the no-position part, then the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_a_rows(self) -> int:
        """`kv_a_proj_with_mqa` rows: the compressed KV, then the one shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_b_head_rows(self) -> int:
        """`kv_b_proj` rows per head: the head's no-position key, then its value."""
        return self.qk_nope_head_dim + self.v_head_dim
