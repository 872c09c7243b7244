"""The tensors a vLLM model's checkpoint holds (name, shape, dtype), without reading them.

The fail-safe path traces which checkpoint tensors land in parameters no layer rule
describes (`vllm_load_trace`); it needs the checkpoint's tensor names to trace. They come
from, in order:

1. the safetensors files of the checkpoint vLLM loaded (a local directory, or the Hugging
   Face cache for a Hub id): only the JSON headers are read, a few kB per file;
2. for checkpoints without files (`load_format="dummy"`), the transformers model built from
   the same config on the meta device. Its names are the checkpoint names for every
   architecture whose transformers class loads checkpoints without renaming; transformers 5
   renames some (fused MoE experts), which the fast-path rules cover, so only tensors that
   land in fallback parameters are ever looked up here.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from refitplane.errors import LayoutError
from refitplane.reshard.dtypes import canonical_dtype
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import dtype_name

log = logging.getLogger("refitplane.generator.checkpoint_index")

# safetensors header dtype codes → layout dtype names.
_SAFETENSORS_DTYPES: Final[dict[str, str]] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER_BYTES: Final = 100 * 1024 * 1024


def safetensors_specs(directory: str | Path) -> dict[str, TensorSpec]:
    """Every tensor in the `*.safetensors` files of `directory`, from their headers."""
    specs: dict[str, TensorSpec] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        for name, entry in _header(file).items():
            if name == "__metadata__":
                continue
            code = str(entry.get("dtype", ""))
            dtype = _SAFETENSORS_DTYPES.get(code)
            if dtype is None:
                raise LayoutError(
                    f"{file.name}: unsupported safetensors dtype {code!r}",
                    tensor=name,
                    field="dtype",
                )
            specs[name] = TensorSpec.create(name, [int(n) for n in entry["shape"]], dtype)
    return specs


def _header(file: Path) -> dict[str, Any]:
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise LayoutError(f"{file} is too short to be a safetensors file", field="checkpoint")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER_BYTES:
            raise LayoutError(
                f"{file} has a {size}-byte header: not safetensors", field="checkpoint"
            )
        header: dict[str, Any] = json.loads(f.read(size))
    return header


@dataclass(frozen=True)
class CheckpointIndex:
    """Checkpoint tensors by name; `exact` when read from the checkpoint's own files, not
    when reconstructed from the transformers model (whose names may differ from the
    checkpoint's where transformers fuses or renames tensors)."""

    specs: Mapping[str, TensorSpec]
    exact: bool = True


def checkpoint_specs(model_config: Any) -> CheckpointIndex:
    """The checkpoint tensors of the model vLLM serves (`vllm_config.model_config`)."""
    directory = _local_checkpoint_dir(model_config)
    if directory is not None:
        specs = safetensors_specs(directory)
        if specs:
            return CheckpointIndex(specs)
    log.info(
        "refitplane: no safetensors files for %s; checkpoint names from the transformers model",
        getattr(model_config, "model", "?"),
    )
    return CheckpointIndex(
        meta_model_specs(model_config.hf_config, dtype_name(model_config.dtype)), exact=False
    )


def _local_checkpoint_dir(model_config: Any) -> Path | None:
    model = str(getattr(model_config, "model", ""))
    if model and Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        cached = snapshot_download(
            model,
            revision=getattr(model_config, "revision", None),
            local_files_only=True,
            allow_patterns=["*.safetensors"],
        )
    except Exception:  # noqa: BLE001 - not in the local cache (or no hub): no files
        return None
    return Path(cached)


def meta_model_specs(hf_config: Any, dtype: str) -> dict[str, TensorSpec]:
    """Parameter names and shapes of the transformers model for `hf_config`, built on the
    meta device (no memory); every tensor in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
    dtype = canonical_dtype(dtype)
    return {
        name: TensorSpec.create(name, list(param.shape), dtype)
        for name, param in model.state_dict().items()
    }
