"""How Hugging Face checkpoint tensors split over a tensor-parallel group (Megatron / vLLM
conventions), as DTensor-style placements: column-parallel weights (q/k/v, gate/up,
embeddings, lm_head) shard dim 0, row-parallel ones (o_proj, down_proj) shard dim 1,
routed experts are spread whole over the ranks (expert parallel), everything else
(norms, routers, biases, block scales) is replicated. Used by the reference engine and
by tests that need a TP layout of an HF state dict without vLLM or Megatron.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from refitplane.reshard.boxes import Box, full_box
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.placements import DeviceMesh, Replicate, Shard, placement_boxes

_COLUMN = re.compile(
    r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$|^model\.embed_tokens\.weight$|^lm_head\.weight$"
)
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def tp_boxes(spec: TensorSpec, tp_size: int, ranks: Iterable[int] | None = None) -> dict[int, Box]:
    """The box each TP rank holds of `spec` (ranks default to 0..tp_size-1)."""
    rank_list = list(range(tp_size)) if ranks is None else list(ranks)
    mesh = DeviceMesh.create([tp_size], rank_list, tensor=spec.name)
    expert = _EXPERT.search(spec.name)
    if expert is not None:
        # Expert parallel: expert e lives whole on one rank, contiguous blocks of experts.
        return {rank_list[int(expert.group(1)) % tp_size]: full_box(spec.shape)}
    if _COLUMN.search(spec.name) and spec.shape:
        return placement_boxes(spec.shape, mesh, [Shard(0)], tensor=spec.name)
    if _ROW.search(spec.name) and len(spec.shape) == 2:
        return placement_boxes(spec.shape, mesh, [Shard(1)], tensor=spec.name)
    return placement_boxes(spec.shape, mesh, [Replicate()], tensor=spec.name)
