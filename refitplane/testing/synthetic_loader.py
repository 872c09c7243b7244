"""A vLLM model loader whose checkpoint is the synthetic weights of a model shape
(`synthetic_weights.synthetic`, the bytes a refit world's trainers hold): a *fresh* vLLM load
of the checkpoint the trainers hold, without writing it (the Qwen3-30B-A3B shape is 57 GiB
in bf16; the device's disk is 64 GiB and writing takes minutes).

It is vLLM's own load path with another source of tensors: `BaseModelLoader.load_model`
builds the model, this loader's `load_weights` hands the model's `load_weights` every
checkpoint tensor, generated one at a time on the worker's device (where the trainers
generate them: the values are the same on any CUDA device), and vLLM then runs its
post-load processing (FP8 repacking, Mamba / MLA derived tensors) as on any start.

    LLM(model=<dir with config.json>, load_format=LOAD_FORMAT,
        worker_extension_cls=WORKER_EXTENSION,
        model_loader_extra_config={"shape": "qwen3-8b", "dtype": "bfloat16", "quant": "",
                                   "steps": [["flip", 0.01, 7], ...]})

`steps` (optional): the benchmark's changes to the synthetic weights, replayed on each tensor
before vLLM sees it (`synthetic_weights.replayed`): the checkpoint a trainer holds after
those optimizer steps.

vLLM looks loaders up by name in the process that builds the model (a worker); importing
this module registers it, and `worker_extension_cls` makes every worker import it before
it loads the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from vllm.model_executor.model_loader import BaseModelLoader, register_model_loader

from refitplane.testing.model_shapes import tensor_specs
from refitplane.testing.synthetic_weights import replayed

LOAD_FORMAT = "refit_synthetic"
WORKER_EXTENSION = "refitplane.testing.synthetic_loader.ImportsSyntheticLoader"


class SyntheticCheckpointLoader(BaseModelLoader):
    """Loads `model_loader_extra_config`'s {"shape", "dtype", "quant", "steps"} synthetic
    checkpoint (`model_shapes.tensor_specs`) through the model's own `load_weights`."""

    def download_model(self, model_config: Any) -> None:
        pass  # nothing to download: the tensors are generated

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        extra = dict(self.load_config.model_loader_extra_config or {})
        if "shape" not in extra:
            raise ValueError(
                f"load_format={LOAD_FORMAT!r} needs model_loader_extra_config "
                f'{{"shape": ..., "dtype": ..., "quant": ...}}, got {extra}'
            )
        device = next(model.parameters()).device
        specs = tensor_specs(extra["shape"], extra.get("dtype", "bfloat16"), extra.get("quant", ""))
        steps = [
            (str(kind), float(amount), int(seed)) for kind, amount, seed in extra.get("steps", [])
        ]

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for ts in specs:
                yield ts.name, replayed(ts.name, ts.shape, ts.dtype, device, steps)

        loads: Any = model  # vLLM models define load_weights; nn.Module does not
        loads.load_weights(weights())


class ImportsSyntheticLoader:
    """`worker_extension_cls` for a fresh synthetic load: no methods; vLLM imports this
    module in every worker to find it, which registers the loader there."""


register_model_loader(LOAD_FORMAT)(SyntheticCheckpointLoader)
