"""A small deterministic "model" for reliability tests: a Hugging Face-named state dict whose
every byte is a function of the weight version, and digests of what a rank holds.

Trainer processes hold their tensor-parallel share of `synthetic_state(v)` after "training
step" v; a generator that committed version v must hold exactly its share of it, and one that
failed a refit must either hold its previous version's share byte for byte or say it is not
ready. `shard_digests` lets a test compare both without moving tensors between processes.

The tensors mix the dtypes and layouts refits meet in practice: column- and row-parallel bf16
weights (row-parallel ones arrive as non-contiguous boxes), fp32 norms replicated on every
rank, FP8 weights with a block scale, and whole experts spread over the ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from refitplane.generator.reference_engine import shard_state, specs_of
from refitplane.reshard.boxes import to_slices
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import LocalShards

# Rows of the embedding; `scale` multiplies it (the other tensors stay small).
_VOCAB = 256
_HIDDEN = 64
_FFN = 96


def synthetic_state(version: int, *, scale: int = 1) -> dict[str, torch.Tensor]:
    """The full state dict after step `version` (version 0: the generators' initial weights)."""
    g = torch.Generator().manual_seed(1_000_003 * version + 17)

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    state = {
        "model.embed_tokens.weight": bf16(_VOCAB * scale, _HIDDEN),
        "model.norm.weight": torch.randn(_HIDDEN, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(_HIDDEN, generator=g),
        "model.layers.0.self_attn.q_proj.weight": bf16(_HIDDEN, _HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": bf16(_HIDDEN, _HIDDEN),
        "model.layers.0.mlp.down_proj.weight": bf16(_HIDDEN, _FFN),
        "model.layers.0.mlp.gate_proj.weight": torch.randint(
            -100, 100, (_FFN, _HIDDEN), generator=g, dtype=torch.int8
        ).view(torch.float8_e4m3fn),
        "model.layers.0.mlp.gate_proj.weight_scale_inv": torch.rand(1, 1, generator=g),
    }
    for expert in range(4):
        state[f"model.layers.0.mlp.experts.{expert}.up_proj.weight"] = bf16(_FFN, _HIDDEN)
    return state


def synthetic_specs(*, scale: int = 1) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes (the same for every version)."""
    return specs_of(synthetic_state(0, scale=scale))


def rank_shards(version: int, rank: int, tp_size: int, *, scale: int = 1) -> LocalShards:
    """Rank `rank`'s tensor-parallel share of `synthetic_state(version)`, as fresh storage."""
    state = synthetic_state(version, scale=scale)
    return shard_state(specs_of(state), rank, tp_size, torch.device("cpu"), state)


def shard_digests(shards: LocalShards) -> dict[str, str]:
    """`{tensor name: sha256 of the bytes of every box the rank holds}`."""
    out: dict[str, str] = {}
    for name in shards.names():
        h = hashlib.sha256()
        for sv in shards.views_of(name):
            h.update(sv.tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def expected_digests(version: int, rank: int, tp_size: int, *, scale: int = 1) -> dict[str, str]:
    """What `shard_digests` of a rank holding exactly `version` returns."""
    return shard_digests(rank_shards(version, rank, tp_size, scale=scale))


def load_state_into(shards: LocalShards, state: Mapping[str, torch.Tensor]) -> None:
    """Overwrite every view of `shards` in place with its box of `state` (a training step)."""
    for sv in shards:
        sv.tensor.copy_(state[sv.spec.name][to_slices(sv.box)])
