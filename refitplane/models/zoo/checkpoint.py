"""Zoo checkpoints on disk: write one (`write_zoo_model`), read back how it was written
(`read_zoo_record`), and pick a seed whose greedy tokens are well separated
(`confident_zoo_seed`).

Tensor names and shapes are the Hub's: transformers 5 fuses some checkpoint tensors in
memory and renames others, and `save_pretrained` reverts that, so they are taken from what
it writes; values are then generated per checkpoint name, deterministic in
`(seed, checkpoint name)`.
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch

from refitplane.errors import InvalidArgument
from refitplane.models.tiny import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    WEIGHTS_FILE,
    _tensor_seed,
    greedy_margin,
    hf_greedy_tokens,
    load_hf_model,
)
from refitplane.models.zoo.arch import ZooArch
from refitplane.models.zoo.catalog import zoo_arch, zoo_config
from refitplane.reshard.dtypes import canonical_dtype
from refitplane.reshard.shards import torch_dtype

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The safetensors metadata key that records how a zoo checkpoint was written.
ZOO_METADATA_KEY: Final = "refitplane_zoo"


def write_zoo_model(
    path: str | Path,
    arch: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Write a zoo checkpoint directory and return its path.

    `arch` is a `ZOO` key; keyword arguments override config fields (e.g.
    `num_hidden_layers=3`, `hidden_size=256`). The directory is created if needed; existing
    checkpoint files in it are replaced.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidArgument(f"seed must be a non-negative integer, got {seed!r}", field="seed")
    entry = zoo_arch(arch)
    config = zoo_config(arch, dtype=dtype, **config_overrides)
    given = {**entry.config, **config_overrides}
    config_json = _hub_config_json(entry, config, given)
    key = json.dumps({**given, "model_type": entry.model_type}, sort_keys=True, default=str)
    architecture, shapes = _hub_tensor_shapes(key)
    config_json["architectures"] = [entry.hub_architecture or architecture]

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    # No EOS: generation always runs to max_tokens, so vLLM and reference runs stay aligned.
    generation = {"do_sample": False, "bos_token_id": None, "eos_token_id": None}
    (root / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    target = torch_dtype(canonical_dtype(dtype))
    tensors = {
        name: _tensor_values(entry, config, name, shape, seed, target) for name, shape in shapes
    }
    record = {
        "arch": arch,
        "seed": seed,
        "dtype": canonical_dtype(dtype),
        "overrides": config_overrides,
    }
    meta = {"format": "pt", ZOO_METADATA_KEY: json.dumps(record, sort_keys=True, default=str)}
    (root / WEIGHTS_FILE).write_bytes(_safetensors_bytes(tensors, meta))
    return root


_SAFETENSORS_DTYPES: Final[Mapping[torch.dtype, str]] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
}


def _safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """A safetensors file, byte for byte the same for the same input.

    `safetensors.torch.save_file` keeps the metadata in a Rust HashMap, whose order (and so
    the file's bytes) changes from call to call; the format is simple enough to write here:
    an 8-byte little-endian header length, a JSON header (padded with spaces to a multiple
    of 8), then the tensors' little-endian bytes back to back."""
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise InvalidArgument(f"{name} is {tensor.dtype}", field="dtype")
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def read_zoo_record(path: str | Path) -> dict[str, Any]:
    """How a zoo directory was written: `{"arch", "seed", "dtype", "overrides"}`."""
    from safetensors import safe_open

    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise InvalidArgument(f"no {WEIGHTS_FILE} in {path}", field="path")
    with safe_open(str(file), framework="pt") as f:
        raw = (f.metadata() or {}).get(ZOO_METADATA_KEY)
    if raw is None:
        raise InvalidArgument(f"{file} was not written by write_zoo_model", field="path")
    record: dict[str, Any] = json.loads(raw)
    return record


def confident_zoo_seed(
    path: str | Path,
    arch: str,
    *,
    start: int,
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
    min_margin: float = 0.1,
    min_distinct_tokens: int = 3,
    tries: int = 20,
    dtype: str = "float32",
    **config_overrides: Any,
) -> tuple[int, Path]:
    """Write checkpoints of `arch` with seeds start, start+1, ... to `path` until one's
    transformers greedy continuation (computed in `dtype`) has logit gaps of at least
    `min_margin` and at least `min_distinct_tokens` different tokens; returns (seed, path).

    Float32 engines differ by ~1e-5 in the logits, so a margin of 0.1 is ample; the
    distinct-token floor skips seeds whose model falls into repeating one token, which
    would let a comparison pass on a model that mostly ignores its input."""
    for seed in range(start, start + tries):
        out = write_zoo_model(path, arch, seed=seed, dtype=dtype, **config_overrides)
        model = load_hf_model(out, dtype=dtype)
        tokens = hf_greedy_tokens(model, prompt_token_ids, max_new_tokens)
        if (
            len(set(tokens)) >= min(min_distinct_tokens, max_new_tokens)
            and greedy_margin(model, prompt_token_ids, max_new_tokens) >= min_margin
        ):
            return seed, out
    raise InvalidArgument(
        f"no {arch} seed in [{start}, {start + tries}) has a greedy margin of {min_margin} "
        f"and {min_distinct_tokens} distinct tokens",
        field="seed",
    )


def _hub_config_json(
    entry: ZooArch, config: PretrainedConfig, given: Mapping[str, Any]
) -> dict[str, Any]:
    """`config.json` contents in the Hub's spelling, readable by transformers 4.5x too.

    `given` are the arguments the config was made from: a field given under an alias
    (`num_experts`, which transformers 5 stores as `num_local_experts` for Qwen3-MoE) is
    written under that name, as the Hub's configs spell it and older versions read it."""
    out: dict[str, Any] = config.to_diff_dict()  # what save_pretrained writes
    for key in ("transformers_version", "_name_or_path"):
        out.pop(key, None)
    for alias, target in getattr(config, "attribute_map", {}).items():
        if alias in given and target in out and alias not in out:
            out[alias] = out.pop(target)
    # Old spellings beside the new ones, as tiny.py writes them: vLLM on the GPU machines
    # runs with transformers 4.5x, which reads torch_dtype / rope_theta / rope_scaling.
    out["torch_dtype"] = out.get("dtype")
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if entry.model_type == "nemotron_h":
        # Hub Nemotron-H configs (and transformers < 5) name the layer kinds with
        # hybrid_override_pattern; transformers 5 converts it on load and writes
        # layers_block_type, which older versions cannot set (it is a property there).
        out["hybrid_override_pattern"] = config.hybrid_override_pattern
        out["num_hidden_layers"] = len(config.hybrid_override_pattern)
        out.pop("layers_block_type", None)
    if "time_step_limit" in out:
        # transformers 5 writes inf as {"__float__": "Infinity"}; the Hub has a bare Infinity.
        out["time_step_limit"] = list(config.time_step_limit)
    return out


@lru_cache(maxsize=64)
def _hub_tensor_shapes(
    config_kwargs: str,
) -> tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]:
    """(model class name, (checkpoint name, shape) pairs) of the Hub checkpoint of a config
    (`config_kwargs`: JSON of `model_type` and the `AutoConfig.for_model` arguments).

    transformers 5 knows how its in-memory parameters map back to the Hub's tensors (fused
    experts split per expert, prefixes renamed, tied weights dropped) and applies that in
    `save_pretrained`; the names and shapes are read from what it writes.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config_kwargs)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    factory: Any = AutoModelForCausalLM  # from_config is untyped
    model = factory.from_config(config, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="refitplane-zoo-") as tmp:
        model.save_pretrained(tmp)
        files = sorted(Path(tmp).glob("*.safetensors"))
        if [f.name for f in files] != [WEIGHTS_FILE]:
            raise InvalidArgument(
                f"transformers wrote {[f.name for f in files]} for a tiny model", field="arch"
            )
        with safe_open(str(files[0]), framework="pt") as f:
            shapes = tuple((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())  # noqa: SIM118
    return type(model).__name__, shapes


def _tensor_values(
    entry: ZooArch,
    config: PretrainedConfig,
    name: str,
    shape: tuple[int, ...],
    seed: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The values of checkpoint tensor `name`, deterministic in (seed, name)."""
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    module, _, leaf = name.rpartition(".")
    hidden = int(config.hidden_size)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if leaf == "A_log":
        # Mamba2's init: A = -exp(A_log) uniform in [-16, -1], decays that neither vanish
        # nor blow up the state.
        values = torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen))
    elif leaf == "dt_bias":
        # softplus(dt_bias) = dt log-uniform in [0.01, 0.1] (Mamba2's init range).
        lo, hi = math.log(0.01), math.log(0.1)
        dt = torch.exp(lo + (hi - lo) * torch.rand(shape, generator=gen))
        values = dt + torch.log(-torch.expm1(-dt))
    elif leaf == "D":
        values = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    elif leaf == "e_score_correction_bias":
        # Shifts which experts are chosen, without deciding it alone (scores are sigmoids);
        # float32 as in the Hub checkpoints and transformers (_keep_in_fp32_modules_strict).
        return (0.1 * torch.randn(shape, generator=gen)).contiguous()
    else:
        normal = torch.randn(shape, generator=gen)
        if name == "lm_head.weight":
            # Logit std ≈ 4: top tokens far apart, greedy robust to kernel differences.
            values = normal * (4.0 / math.sqrt(hidden))
        elif leaf == "weight" and module.endswith(("embed_tokens", "embeddings")):
            # Untied: unit size, as tiny.py. Tied: rows of unit norm, so the logits (read
            # through the final norm, below) have the untied lm_head's size.
            values = normal * (1.0 / math.sqrt(hidden) if tied else 1.0)
        elif leaf == "weight" and len(shape) == 1 and "norm" in module.rpartition(".")[2]:
            # Not all ones: a norm loaded into the wrong place must show up in comparisons.
            # The final norm of a tied model is a zero-mean scale of size 4 instead: the
            # logit of the token just read contains Σ scale_i·e_i², which with a positive
            # scale wins every step (the model repeats its input); random signs cancel it,
            # and size 4 gives logits of std ≈ 4 as the untied lm_head does.
            final_of_tied = tied and ".layers." not in name
            scale = 4.0 * normal if final_of_tied else 1.0 + 0.1 * normal
            values = scale - 1.0 if entry.norm_adds_one else scale
        elif len(shape) == 1 or leaf.endswith("bias"):
            # Biases (incl. gpt-oss's 2-D expert biases), attention sinks: small, nonzero.
            values = 0.1 * normal
        else:
            # 1/sqrt(fan_in) keeps each projection's output at the size of its input.
            fan_in = shape[-2] if name.endswith(entry.in_features_first) else shape[-1]
            values = normal / math.sqrt(fan_in)
    return values.to(dtype).contiguous()
