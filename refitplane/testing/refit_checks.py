"""Checks run inside vLLM workers after a refit (`llm.collective_rpc(check_refit, ...)`).

Every vLLM parameter must equal what the model's own `load_weights` writes from the full
checkpoint the trainer held: for a staged engine, what `load_weights` writes from the
received staging equals what it writes from the checkpoint (and every received box equals
the checkpoint's box); for a live engine, the live parameters themselves.
"""

from __future__ import annotations

from typing import Any

import torch

from refitplane.models.tiny import load_checkpoint
from refitplane.reshard.boxes import format_box, to_slices
from refitplane.testing.vllm_reference import loaded_reference, received_parameters


def check_refit(worker: Any, checkpoint_dir: str) -> dict[str, Any]:
    engine = worker.weight_transfer_engine
    model = worker.model_runner.get_model()
    if engine is None or engine.shards is None:
        return {"failures": ["no refitplane engine in this worker"], "mode": "", "error": ""}
    layout = engine.layout
    checkpoint = load_checkpoint(checkpoint_dir)
    failures: list[str] = []
    # Live views are the parameters themselves, staged ones the staging: both hold the
    # checkpoint's boxes as received. Fallback tensors are not compared here: vLLM's own
    # loader consumes them and may write into them (gpt-oss zeroes the row-parallel expert
    # bias it is handed on TP ranks > 0); the parameters they load are compared below.
    consumed_by_vllm = set(layout.fallback_tensors)
    for sv in engine.shards:
        if sv.spec.name in consumed_by_vllm:
            continue
        want = checkpoint[sv.spec.name][to_slices(sv.box)]
        if not torch.equal(
            sv.tensor.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
        ):
            failures.append(
                f"{sv.spec.name}{format_box(sv.box)}: received bytes differ from the checkpoint"
            )
    got = received_parameters(model, engine)
    want_params = loaded_reference(model, layout, checkpoint.items())
    for name in sorted(want_params):
        if not torch.equal(got[name], want_params[name]):
            failures.append(f"{name}: differs from what load_weights writes from the checkpoint")
    return {
        "mode": engine.mode,
        "error": engine.error,
        "params": len(layout.params),
        "fallback_params": len(layout.fallback),
        "summary": layout.summary(),
        "failures": failures,
        "tp_rank": layout.ranks.tp_rank,
    }
