"""Trainer-side shard layouts of a Hugging Face state dict, for the vLLM refit tests.

`trainer_shards(state, rank, world, "tp")` holds each tensor the way a TP trainer does
(column/row splits, experts spread over the ranks: `hf_tensor_parallel`); `"pp"` splits the
decoder layers into contiguous stages (embedding on the first, final norm and LM head on
the last), each tensor whole.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from refitplane.errors import InvalidArgument
from refitplane.generator.hf_tensor_parallel import tp_boxes
from refitplane.reshard.boxes import Box, box_shape, full_box, to_slices
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import LocalShards, dtype_name

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _pp_owner(name: str, world: int, num_layers: int) -> int:
    layer = _LAYER.search(name)
    if layer is not None:
        per_stage = -(-num_layers // world)
        return int(layer.group(1)) // per_stage
    return 0 if "embed_tokens" in name else world - 1


def trainer_boxes(
    state: Mapping[str, torch.Tensor], rank: int, world: int, policy: str
) -> dict[str, Box]:
    specs = {n: TensorSpec.create(n, list(t.shape), dtype_name(t.dtype)) for n, t in state.items()}
    out: dict[str, Box] = {}
    if policy == "tp":
        for name, spec in specs.items():
            box = tp_boxes(spec, world).get(rank)
            if box is not None:
                out[name] = box
        return out
    if policy == "pp":
        layers = [int(m.group(1)) for n in specs if (m := _LAYER.search(n))]
        num_layers = max(layers) + 1 if layers else 1
        return {
            n: full_box(s.shape)
            for n, s in specs.items()
            if _pp_owner(n, world, num_layers) == rank
        }
    raise InvalidArgument(f"unknown trainer layout policy {policy!r} (tp, pp)", field="policy")


def trainer_shards(
    state: Mapping[str, torch.Tensor], rank: int, world: int, policy: str
) -> LocalShards:
    """This rank's shards as its own storage (copies of the boxes it holds)."""
    shards = LocalShards()
    for name, box in sorted(trainer_boxes(state, rank, world, policy).items()):
        t = state[name]
        local = torch.empty(box_shape(box), dtype=t.dtype)
        local.copy_(t[to_slices(box)])
        shards.add(TensorSpec.create(name, list(t.shape), dtype_name(t.dtype)), box, local)
    return shards
