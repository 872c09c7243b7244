"""One trainer rank of a refit world: a spawned process, pinned to a GPU (or the CPU), holding
its tensor-parallel share of the synthetic weights (the HF tensor-parallel split), served by
a real `TrainerAgent`. On its command queue: "mem" (peak extra GPU memory since the last
ask), "report" (the agent's last `TransferReport`), ("step", step) (change the weights as an optimizer step would, `synthetic_weights.
apply_step`, under the agent's write lock), ("tokens", (prompt, n)) (greedy tokens and the
top-two logit margins of a transformers model over this rank's weights, which must hold
every tensor whole: TP 1), ("top1", sequence) (the same model's most likely next token and
margin at every position of a sequence, teacher-forced), "stop". It puts ("ready", rank, bytes held) once published, ("error", rank, traceback)
if anything fails.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from dataclasses import dataclass
from typing import Any

from refitplane.testing.model_shapes import tensor_specs
from refitplane.testing.process_world import SAFE_ENV
from refitplane.testing.synthetic_weights import synthetic


@dataclass(frozen=True)
class TrainerSpec:
    shape: str
    dtype: str
    coordinator: str
    job: str
    world_size: int
    device: str  # "cuda" or "cpu"
    full: bool = False  # hold every tensor whole (the baseline broadcaster)
    quant: str = ""


def trainer_main(rank: int, spec: TrainerSpec, commands: Any, results: Any) -> None:
    os.environ.update(SAFE_ENV)
    try:
        import torch

        from refitplane.generator.hf_tensor_parallel import tp_boxes
        from refitplane.reshard.boxes import box_shape, to_slices
        from refitplane.reshard.shards import LocalShards
        from refitplane.trainer.agent import TrainerAgent

        device = torch.device("cuda", rank) if spec.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        shards = LocalShards()
        for ts in tensor_specs(spec.shape, spec.dtype, spec.quant):
            box = tp_boxes(ts, spec.world_size).get(rank)
            if box is None:
                continue
            full = synthetic(ts.name, ts.shape, ts.dtype, device)
            local = torch.empty(box_shape(box), dtype=full.dtype, device=device)
            local.copy_(full[to_slices(box)])
            shards.add(ts, box, local)
            del full
        agent = TrainerAgent(
            coordinator=spec.coordinator,
            job=spec.job,
            rank=rank,
            world_size=spec.world_size,
            shards=shards,
            device=device,
            host="127.0.0.1",
        )
        agent.start()
        steps: list[Any] = []
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        results.put(
            ("ready", rank, sum(sv.tensor.numel() * sv.tensor.element_size() for sv in shards))
        )
        while True:
            command = commands.get(timeout=3600)
            if command == "mem":
                peak = (
                    torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
                )
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                results.put(("mem", rank, int(peak)))
            elif command == "stop":
                break
            elif command[0] == "step":
                steps.append(command[1])
                _step(agent, shards, steps, device)
                results.put(("step", rank, len(steps)))
            elif command == "report":
                last = agent.member.last_report
                results.put(("report", rank, dataclasses.asdict(last) if last else {}))
            elif command[0] == "tokens":
                results.put(("tokens", rank, _hf_tokens(spec, shards, *command[1])))
            elif command[0] == "top1":
                results.put(("top1", rank, _hf_top1(spec, shards, command[1])))
            elif command[0] == "presum":
                # Whether this rank checksums CUDA IPC links at PrepareRefit (a benchmark's
                # comparison in one world; read at each prepare).
                from refitplane.reshard import ipc_run

                ipc_run.PRESUM = bool(command[1])
                results.put(("presum", rank, ipc_run.PRESUM))
            elif command[0] == "step_sums":
                # Whether this rank's steps take the next refit's CUDA IPC sums at their end
                # (`presum_after_step`, the default) or leave them to PrepareRefit.
                on = bool(command[1])
                member = agent.member
                if on:
                    vars(member).pop("presum_after_step", None)  # the class's own again
                else:
                    member.presum_after_step = lambda writes: False  # type: ignore[method-assign]
                results.put(("step_sums", rank, on))
            elif command[0] == "ipc_handles":
                results.put(("ipc_handles", rank, _ipc_handles(shards, device)))
        agent.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _ipc_handles(shards: Any, device: Any) -> dict[str, Any]:
    """vLLM's `ipc` engine, trainer side, over this rank's tensors (whole at TP 1): the
    update info its `IPCWeightTransferEngine.trainer_send_weights` builds (names, dtypes,
    shapes, one `reduce_tensor` handle per tensor keyed by this GPU's UUID), and the
    seconds it took."""
    import time

    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    started = time.perf_counter()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    info: dict[str, Any] = {"names": [], "dtype_names": [], "shapes": [], "ipc_handles": []}
    for sv in shards:
        info["names"].append(sv.spec.name)
        info["dtype_names"].append(str(sv.tensor.dtype).split(".")[-1])
        info["shapes"].append(list(sv.tensor.shape))
        info["ipc_handles"].append(
            {uuid: reduce_tensor(sv.tensor.detach().contiguous())}  # type: ignore[no-untyped-call]
        )
    info["seconds"] = time.perf_counter() - started
    return info


def _step(agent: Any, shards: Any, steps: list[Any], device: Any) -> None:
    from refitplane.reshard.boxes import full_box, to_slices
    from refitplane.testing.synthetic_weights import apply_step, replayed

    with agent.updating_weights():
        for sv in shards:
            if sv.box == full_box(sv.spec.shape):
                apply_step(sv.spec.name, sv.tensor, steps[-1])
            else:
                full = replayed(sv.spec.name, sv.spec.shape, sv.spec.dtype, device, steps)
                sv.tensor.copy_(full[to_slices(sv.box)])


def _hf_model(spec: TrainerSpec, shards: Any) -> Any:
    """transformers' Qwen3 over the rank's own tensors (shared, not copied: never a float32
    copy of the model)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from refitplane.testing.model_shapes import model_spec

    config = model_spec(spec.shape, spec.dtype).hf_config()
    if config["model_type"] != "qwen3":
        raise ValueError(f"tokens: dense Qwen3 shapes only, not {config['model_type']}")
    first = next(iter(shards)).tensor
    saved = torch.get_default_dtype()
    torch.set_default_dtype(first.dtype)
    try:
        with torch.device(first.device):
            model = Qwen3ForCausalLM(Qwen3Config(**config))  # type: ignore[no-untyped-call]
    finally:
        torch.set_default_dtype(saved)
    model.load_state_dict({sv.spec.name: sv.tensor for sv in shards}, strict=False, assign=True)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def _hf_tokens(spec: TrainerSpec, shards: Any, prompt: list[int], n: int) -> dict[str, Any]:
    """Greedy continuation by transformers over the rank's own tensors, with the gap between
    the two best logits at each step: engines computing in bf16 can only be expected to
    agree where that gap is clear."""
    import torch

    model = _hf_model(spec, shards)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    tokens: list[int] = []
    margins: list[float] = []
    past = None
    with torch.no_grad():
        for _ in range(n):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            logits = out.logits[0, -1].float()
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
            tokens.append(int(logits.argmax()))
            ids = torch.tensor([[tokens[-1]]], dtype=torch.long, device=device)
            past = out.past_key_values
    del model  # in this scope, before the cache is emptied
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens": tokens, "margins": margins}


def _hf_top1(spec: TrainerSpec, shards: Any, sequence: list[int]) -> dict[str, Any]:
    """Teacher-forced: for every position of `sequence`, the most likely next token given
    the tokens up to it, and the gap to the second (one forward pass). Unlike a greedy
    continuation, one near-tie does not end the comparison: every position with a clear
    gap is compared, whatever came before it."""
    import torch

    model = _hf_model(spec, shards)
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sequence], device=device)).logits[0].float()
    top = logits.topk(2, dim=-1)
    result = {
        "top1": [int(t) for t in top.indices[:, 0].tolist()],
        "margins": [float(m) for m in (top.values[:, 0] - top.values[:, 1]).tolist()],
    }
    del model  # in this scope, before the cache is emptied
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result
