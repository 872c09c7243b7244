"""DeepSeek-V3 multi-token-prediction (MTP) layers for a tiny zoo checkpoint.

DeepSeek-V3 checkpoints hold their MTP layers in the same files as the model, past
`num_hidden_layers`: layer `L = num_hidden_layers` has a whole decoder block (attention and
MoE, names as any layer's) plus `enorm`, `hnorm`, `eh_proj` (`[H, 2H]`), `shared_head.norm`,
`shared_head.head` (`[V, H]`) and its own copy of `embed_tokens`. vLLM serves them as the
draft of `speculative_config={"method": "mtp"}` (`DeepSeekMTP`, whose `load_weights` renames
the block to `model.layers.L.mtp_block.*` and maps `embed_tokens` to the shared top-level
one). transformers' DeepseekV3 class has no MTP layers, so the zoo writes none:
`add_mtp_layer` adds one, its block shaped like the last decoder layer, values seeded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from refitplane.models.tiny import load_checkpoint

WEIGHTS_FILE = "model.safetensors"


def add_mtp_layer(directory: Path, *, seed: int) -> list[str]:
    """Add one MTP layer to the zoo checkpoint in `directory` (config and weights);
    returns the names of the tensors added."""
    from safetensors.torch import save_file

    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    layers = int(config["num_hidden_layers"])
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    tensors = load_checkpoint(directory)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    generator = torch.Generator().manual_seed(seed)
    dtype = next(iter(tensors.values())).dtype

    def weights(*shape: int, like: torch.Tensor | None = None) -> torch.Tensor:
        scale = float(like.float().std()) if like is not None and like.numel() > 1 else 0.02
        values = torch.randn(*shape, generator=generator) * (scale or 0.02)
        return values.to(dtype)

    added: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.startswith(last):
            if tensor.ndim == 1 and "norm" in name:
                added[mtp + name.removeprefix(last)] = torch.ones_like(tensor)
            else:
                added[mtp + name.removeprefix(last)] = weights(*tensor.shape, like=tensor)
    embed = tensors["model.embed_tokens.weight"]
    added[mtp + "enorm.weight"] = torch.ones(hidden, dtype=dtype)
    added[mtp + "hnorm.weight"] = torch.ones(hidden, dtype=dtype)
    added[mtp + "eh_proj.weight"] = weights(hidden, 2 * hidden)
    added[mtp + "shared_head.norm.weight"] = torch.ones(hidden, dtype=dtype)
    added[mtp + "shared_head.head.weight"] = weights(vocab, hidden, like=embed)
    # Every MTP layer of a DeepSeek-V3 checkpoint repeats the embedding (vLLM loads it
    # into the shared top-level one).
    added[mtp + "embed_tokens.weight"] = embed.clone()
    tensors.update(added)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(directory / WEIGHTS_FILE))
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sorted(added)
