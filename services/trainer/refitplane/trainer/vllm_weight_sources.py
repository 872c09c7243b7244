"""Where the trainer's weights come from for a vLLM weight sync: refitplane's own shards
(`ShardsSource`, boxes in place, nothing gathered), the module behind vLLM's module sources
(described in place), or any other `WeightSource`, staged whole on the sending rank
(`StagedSource`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from refitplane.errors import InvalidArgument
from refitplane.reshard.boxes import full_box
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import LocalShards, dtype_name, torch_dtype


class ShardsSource(WeightSource):
    """A `WeightSource` that is this rank's refitplane shards, e.g.
    `ShardsSource(lambda: megatron_shards(model, hf_config))`.

    Only the refitplane backend reads it: `metadata()` lists the tensors this rank holds
    part of (with their full shapes), and iterating it is refused — nothing is gathered."""

    def __init__(self, shards: Callable[[], LocalShards]) -> None:
        self._shards = shards

    def local_shards(self) -> LocalShards:
        return self._shards()

    def metadata(self) -> list[ParamMeta]:
        shards = self._shards()
        specs = [shards.spec(name) for name in shards.names()]
        return [ParamMeta(s.name, torch_dtype(s.dtype), tuple(s.shape)) for s in specs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError(
            "a ShardsSource holds boxes, not whole tensors: only the refitplane backend reads it"
        )


def in_place_shards(source: WeightSource) -> Callable[[], LocalShards] | None:
    """This rank's shards of `source` described where they lie, nothing copied: a
    `ShardsSource`'s own, or the views of the parameters of the module behind a
    `ModuleSource` / `DTensorModuleSource` (`dtensor_shards`). None for any other source,
    which can only be iterated (`StagedSource`)."""
    if isinstance(source, ShardsSource):
        return source.local_shards
    module = module_of(source)
    if module is None:
        return None
    from refitplane.trainer.layouts import dtensor_shards

    return lambda: dtensor_shards(module.named_parameters())


def module_of(source: object) -> torch.nn.Module | None:
    """The module behind vLLM's `ModuleSource` / `DTensorModuleSource` (both keep it as
    `_module`): its parameters are described in place, without iterating the source."""
    module = getattr(source, "_module", None)
    return module if isinstance(module, torch.nn.Module) else None


class StagedSource:
    """A generic `WeightSource` on the sending rank: one whole-tensor staging buffer per
    tensor (published once), refilled from the source's iteration at every send."""

    def __init__(self, source: WeightSource, device: torch.device) -> None:
        if source.held_names() is not None:
            raise InvalidArgument(
                "a WeightSource split across ranks (held_names) cannot be staged on rank 0; "
                "pass a ModuleSource or refitplane's ShardsSource",
                field="source",
            )
        self.source = source
        self.meta = source.metadata()
        self.staging = {
            m.name: torch.empty(m.shape, dtype=m.dtype, device=device) for m in self.meta
        }
        self.shards = LocalShards()
        for m in self.meta:
            spec = TensorSpec.create(m.name, tuple(m.shape), dtype_name(m.dtype))
            self.shards.add(spec, full_box(m.shape), self.staging[m.name])

    def refill(self, *, keep: bool) -> None:
        """Iterate the source (a collective on every rank); `keep`: copy into staging."""
        count = 0
        for name, tensor in self.source:
            if count >= len(self.meta) or name != self.meta[count].name:
                expected = self.meta[count].name if count < len(self.meta) else "nothing"
                raise InvalidArgument(
                    f"WeightSource yielded {name!r} at position {count}, its metadata() "
                    f"declared {expected!r}",
                    field="source",
                )
            if keep:
                target = self.staging[name]
                if tuple(tensor.shape) != tuple(target.shape) or tensor.dtype != target.dtype:
                    raise InvalidArgument(
                        f"tensor {name!r}: WeightSource yielded {tensor.dtype} "
                        f"{tuple(tensor.shape)}, its metadata() declared {target.dtype} "
                        f"{tuple(target.shape)}",
                        field="source",
                    )
                target.copy_(tensor)
            count += 1
        if count != len(self.meta):
            raise InvalidArgument(
                f"WeightSource yielded {count} tensors, its metadata() declared {len(self.meta)}",
                field="source",
            )
