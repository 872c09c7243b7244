"""The few model dimensions a layout adapter needs to name and size Hugging Face tensors.

Megatron pads the vocabulary and fuses Q/K/V and gate/up; the Hugging Face checkpoint does
neither. The adapter needs the *checkpoint's* sizes to know where the padding starts and
how a fused row range splits, so they come from the Hugging Face config (or are given
explicitly), never from the trainer's padded shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refitplane.errors import LayoutError


def _positive(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{field} must be a positive integer, got {value!r}", field=field)
    return value


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

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_rows(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.num_key_value_heads * self.head_dim

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
        """Read a `transformers` config (Qwen3, Qwen3-MoE, Qwen2, Llama, ...), duck-typed."""

        def get(name: str, default: Any = None) -> Any:
            return getattr(config, name, default)

        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        head_dim = get("head_dim")
        if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads:
            head_dim = hidden // heads
        num_experts = get("num_experts") or get("num_local_experts") or 0
        return ModelDims(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            head_dim=head_dim,
            vocab_size=get("vocab_size"),
            intermediate_size=get("intermediate_size"),
            moe_intermediate_size=get("moe_intermediate_size") if num_experts else None,
            num_experts=int(num_experts),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        )
