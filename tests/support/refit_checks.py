"""Checks run inside vLLM workers after a refit (`llm.collective_rpc(check_refit, ...)`).

`check_refit`: every vLLM parameter must equal what the model's own `load_weights` writes from the full
checkpoint the trainer held: for staged tensors, what `load_weights` writes from the
tensors the engine applied (recorded bucket by bucket: `vllm_reference.record_applied`
must run in the worker before the refit) equals what it writes from the checkpoint, and
every received box equals the checkpoint's box; for a live engine, the live parameters
themselves. `check_synthetic_weights` does the same for a refit world's synthetic weights
(live receive); `parameter_digests` fingerprints what the kernels read, to compare a refitted
replica with one that loaded the same checkpoint.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import torch

from refitplane.models.tiny import load_checkpoint
from refitplane.protocol.draft import draft_name
from refitplane.reshard.boxes import format_box, to_slices
from tests.support.vllm_reference import (
    applied_staging,
    loaded_reference,
    received_parameters,
)


def check_refit(worker: Any, checkpoint_dir: str, draft_dir: str = "") -> dict[str, Any]:
    """`draft_dir`: the speculative draft's checkpoint, when the engine refits the draft too
    (its received boxes are compared under their `draft.` names)."""
    engine = worker.weight_transfer_engine
    model = worker.model_runner.get_model()
    if engine is None or engine.shards is None:
        return {"failures": ["no refitplane engine in this worker"], "mode": "", "error": ""}
    layout = engine.layout
    checkpoint = load_checkpoint(checkpoint_dir)
    # What each received box must hold: the target's tensors, and the draft's by wire name.
    sent = dict(checkpoint)
    if draft_dir:
        sent.update({draft_name(n): t for n, t in load_checkpoint(draft_dir).items()})
    failures: list[str] = []
    # Live views are the parameters themselves; staged tensors exist only while their
    # bucket is applied, so their boxes are read from what the engine applied (recorded
    # before vLLM's loader saw them: it may write into them, as gpt-oss's zeroes the
    # row-parallel expert bias it is handed on TP ranks > 0).
    applied = applied_staging(engine) or {}
    for sv in engine.shards:
        if sv.tensor.is_meta:
            whole = applied.get(sv.spec.name)
            if whole is None:
                failures.append(f"{sv.spec.name}: staged but never applied")
                continue
            received = whole[to_slices(sv.box)]
        else:
            received = sv.tensor
        want = sent[sv.spec.name][to_slices(sv.box)]
        if not torch.equal(
            received.contiguous().cpu().view(torch.uint8), want.contiguous().view(torch.uint8)
        ):
            failures.append(
                f"{sv.spec.name}{format_box(sv.box)}: received bytes differ from the checkpoint"
            )
    got = received_parameters(model, engine)
    want_params = loaded_reference(model, layout, checkpoint.items())
    for name in sorted(want_params):
        if not torch.equal(got[name], want_params[name]):
            failures.append(f"{name}: differs from what load_weights writes from the checkpoint")
    staged = engine.staged
    return {
        "mode": engine.mode,
        "error": engine.error,
        "staging_bytes": staged.staging_bytes if staged is not None else 0,
        "staging_peak_bytes": staged.staging_peak_bytes if staged is not None else 0,
        "params": len(layout.params),
        "fallback_params": len(layout.fallback),
        "summary": layout.summary(),
        "failures": failures,
        "tp_rank": layout.ranks.tp_rank,
    }


def check_synthetic_weights(worker: Any, shape: str, dtype: str) -> dict[str, Any]:
    """In a vLLM worker: every parameter equals what `load_weights` writes from the synthetic
    checkpoint (live receive) — compared by bytes, parameter by parameter."""
    from refitplane.testing.synthetic_weights import synthetic

    engine = worker.weight_transfer_engine
    model = worker.model_runner.get_model()
    layout = engine.layout
    device = next(model.parameters()).device
    needed = {
        name: synthetic(name, spec.shape, spec.dtype, device) for name, spec in layout.specs.items()
    }
    want = loaded_reference(model, layout, needed.items())
    got = received_parameters(model, engine)
    failures = []
    for name in sorted(want):
        if not torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)):
            failures.append(name)
    return {
        "mode": getattr(engine, "mode", ""),
        "params": len(layout.params),
        "fallback_params": len(layout.fallback),
        "summary": layout.summary(),
        "failures": failures,
        "error": getattr(engine, "error", ""),
    }


def parameter_digests(worker: Any) -> dict[str, str]:
    """In a vLLM worker: name → "dtype sha256" (of shape and bytes) of every parameter and
    buffer as the kernels read them (after post-load processing)."""
    model = worker.model_runner.get_model()
    out = {}
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        digest = hashlib.sha256(f"{tensor.dtype} {list(tensor.shape)}".encode())
        digest.update(data.tobytes())
        out[name] = f"{str(tensor.dtype).removeprefix('torch.')} {digest.hexdigest()}"
    return out
