"""Layout sources: what one trainer rank holds of each Hugging Face tensor, as live views.

`megatron_shards` reads Megatron-core models (TP / PP / EP / expert TP, fused QKV and
gate/up, padded vocabulary, tied embeddings, multi-latent attention, shared and grouped
experts); `dtensor_shards` reads DTensor parameters
(FSDP2, torch tensor parallel, both on a 2-D mesh) and plain tensors. Both return a
`LocalShards` whose views alias the parameters, so a refit sends the current weights
without gathering or copying anything.
"""

from refitplane.trainer.layouts.dims import ModelDims
from refitplane.trainer.layouts.dtensor import dtensor_shards
from refitplane.trainer.layouts.megatron import (
    megatron_shards,
    parallel_from_model,
    parallel_from_parallel_state,
)
from refitplane.trainer.layouts.megatron_slicing import GluInterleave, MegatronParallel
from refitplane.trainer.layouts.names import strip_wrapper_prefixes

__all__ = [
    "GluInterleave",
    "MegatronParallel",
    "ModelDims",
    "dtensor_shards",
    "megatron_shards",
    "parallel_from_model",
    "parallel_from_parallel_state",
    "strip_wrapper_prefixes",
]
