"""The driver of a refit world: a coordinator in this process (embedded store), the vLLM
replicas and trainer ranks as spawned processes (`replica`, `trainer`), a refit triggered
through the client and measured (`World.refit`), everything stopped on exit.

    with refit_world(shape="qwen3-8b", device="cuda", trainer_ranks=2, replica_tps=(2,)) as w:
        result = w.refit()
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refitplane.testing.hops import hop_line
from refitplane.testing.model_shapes import write_config
from refitplane.testing.process_world import SAFE_ENV, stop_process
from refitplane.testing.refit_world.replica import ReplicaSpec, replica_main
from refitplane.testing.refit_world.trainer import TrainerSpec, trainer_main

os.environ.update(SAFE_ENV)


def physical_gpus(indices: str) -> str:
    """`indices` (GPUs as this process numbers them, "0,1") as CUDA_VISIBLE_DEVICES for a
    child: through this process's own CUDA_VISIBLE_DEVICES where it has one, so that a world
    started on GPU 1 of a shared machine (CUDA_VISIBLE_DEVICES=1) stays there."""
    parent = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not parent:
        return indices
    out = []
    for k in indices.split(","):
        if not k.strip():
            continue
        if int(k) >= len(parent):
            raise ValueError(
                f"GPU {k} of the refit world is not among CUDA_VISIBLE_DEVICES={','.join(parent)}"
            )
        out.append(parent[int(k)])
    return ",".join(out)


@dataclass
class RefitResult:
    version: int
    state: str
    seconds: float
    transfer_s: float
    bytes_total: int
    tensors_verified: int
    tensors_total: int
    reason: str = ""
    # Seconds per coordinator phase (PREPARING, TRANSFERRING, VERIFYING, COMMITTING, ...).
    phases: dict[str, float] = field(default_factory=dict)
    # What went on the wire (below bytes_total by what delta refits saved), and the
    # replicas that took a delta.
    bytes_on_wire: int = 0
    delta_replicas: tuple[str, ...] = ()
    # The refit's hop timeline (`refitplane.testing.hops.hop_line`).
    hops: str = ""


@dataclass
class World:
    """Trainers + replicas + coordinator; `refit()` runs one refit and measures it."""

    shape: str
    device: str
    trainer_ranks: int = 2
    replica_tps: tuple[int, ...] = (2,)
    dtype: str = "bfloat16"
    workdir: Path = field(default_factory=lambda: Path("/tmp/refit-world"))
    job: str = "bench"
    quant: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    gpu_memory_utilization: float = 0.45
    # CUDA_VISIBLE_DEVICES of each replica (default: the GPUs after the trainers'). "0": on
    # the trainer's GPU (colocated); "1,0": GPU 1, seeing GPU 0 (a cross-GPU CUDA IPC link).
    replica_gpus: tuple[str, ...] = ()
    # vLLM in sleep mode (ReplicaSpec.sleep_level).
    sleep_level: int = 0
    _procs: list[Any] = field(default_factory=list)
    _queues: dict[str, Any] = field(default_factory=dict)
    _results: Any = None
    coordinator: Any = None
    model_dir: Path | None = None
    _client: Any = None

    def start(self, *, load_format: str = "dummy", model_dir: Path | None = None) -> World:
        from refitplane.testing.coordinator import ENGINE_WORLD_LEASE_TTL_S, start_coordinator

        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self.coordinator = start_coordinator(
            **{
                "lease_ttl_s": ENGINE_WORLD_LEASE_TTL_S,
                "prepare_timeout_s": 300.0,
                "transfer_timeout_s": 600.0,
                "group_timeout_s": 300.0,
                "verify_timeout_s": 600.0,
                **self.settings,
            }
        )
        self.model_dir = model_dir or write_config(
            self.workdir / f"model-{self.shape}{self.quant and '-' + self.quant}",
            self.shape,
            self.dtype,
            self.quant,
        )
        gpu = self.trainer_ranks
        for i, tp in enumerate(self.replica_tps):
            rid = f"replica-{i}"
            gpus = ",".join(str(gpu + k) for k in range(tp))
            gpu += tp
            if self.replica_gpus:
                gpus = self.replica_gpus[i]
            gpus = physical_gpus(gpus) if self.device == "cuda" else gpus
            spec = ReplicaSpec(
                str(self.model_dir),
                rid,
                tp,
                gpus,
                self.coordinator.grpc_target,
                self.job,
                self.device,
                dtype=self.dtype,
                load_format=load_format,
                gpu_memory_utilization=self.gpu_memory_utilization,
                sleep_level=self.sleep_level,
            )
            self._spawn(ctx, rid, replica_main, (spec,), visible=gpus)
        replicas = list(self._queues)
        # Trainers on GPUs of their own start while vLLM does (each takes tens of seconds at
        # the MoE shape); where they share GPUs (colocated), after it, so that vLLM's memory
        # profiling sees only its own.
        overlap = self.device == "cuda" and not self.replica_gpus
        if not overlap:
            self._wait_ready(replicas, 1800)
        tspec = TrainerSpec(
            self.shape,
            self.dtype,
            self.coordinator.grpc_target,
            self.job,
            self.trainer_ranks,
            self.device,
            quant=self.quant,
        )
        names = [f"trainer-{r}" for r in range(self.trainer_ranks)]
        for r, name in enumerate(names):
            self._spawn(
                ctx,
                name,
                trainer_main,
                (r, tspec),
                visible=physical_gpus(",".join(str(k) for k in range(self.trainer_ranks))),
            )
        trainers = [str(r) for r in range(self.trainer_ranks)]
        self._wait_ready([*replicas, *trainers] if overlap else trainers, 1800)
        return self

    def _spawn(
        self, ctx: Any, name: str, target: Any, args: tuple[Any, ...], *, visible: str
    ) -> None:
        q = ctx.Queue()
        self._queues[name] = q
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.device == "cuda":
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        try:
            p = ctx.Process(target=target, args=(*args, q, self._results), daemon=False)
            p.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        self._procs.append(p)

    def _wait_ready(self, names: list[str], timeout_s: float) -> None:
        pending = set(names)
        deadline = time.monotonic() + timeout_s
        while pending:
            tag, who, _ = self._get(deadline)
            if tag == "ready":
                pending.discard(str(who))

    def _get(self, deadline: float) -> tuple[str, Any, Any]:
        try:
            item = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("a process of the refit world did not answer in time") from None
        if item[0] == "error":
            raise RuntimeError(f"{item[1]} failed: {item[2]}")
        return item  # type: ignore[no-any-return]

    def ask(self, name: str, command: Any, expect: str, timeout_s: float = 600) -> Any:
        self._queues[name].put(command)
        deadline = time.monotonic() + timeout_s
        while True:
            tag, _, payload = self._get(deadline)
            if tag == expect:
                return payload

    def replicas(self) -> list[str]:
        return [n for n in self._queues if n.startswith("replica-")]

    def configure(self, **settings: Any) -> None:
        """Change the coordinator's transfer settings for the next refits."""
        for key, value in settings.items():
            setattr(self.coordinator.settings, key, value)

    def refit(
        self, timeout_s: float = 900, on_update: Callable[[Any], None] | None = None
    ) -> RefitResult:
        """One refit, triggered and watched until it ends or `timeout_s` passes (then the
        result carries the state it was in). `on_update` sees every record the watch
        yields (state changes, progress): where a stuck refit stopped."""
        client = self._orchestrator()
        started = time.monotonic()
        refit_id = client.trigger(self.job).refit_id
        final = None
        for final in client.watch(refit_id, timeout_s=timeout_s):
            if on_update is not None:
                on_update(final)
            if final.terminal:
                break
        if final is None:
            final = client.get(refit_id)
        seconds = time.monotonic() - started
        members = client.topology(self.job).members  # after the clock: untimed
        names = {
            m.member_id: f"{m.role.value.lower()} {m.replica_id + ' ' if m.replica_id else ''}{m.rank}"
            for m in members
        }
        phases: dict[str, float] = {}
        for t in final.timings:
            phases[t.phase.value] = phases.get(t.phase.value, 0.0) + t.seconds
        return RefitResult(
            final.version,
            final.state.value,
            seconds,
            phases.get("TRANSFERRING", 0.0),
            final.bytes_total,
            final.tensors_verified,
            final.tensors_total,
            f"{final.reason} {final.message}".strip(),
            phases,
            final.bytes_on_wire,
            tuple(final.delta_replicas),
            hop_line(final, names),
        )

    def _orchestrator(self) -> Any:
        """The orchestrator's client, one for the world's life as an RL loop holds one: its
        channel connects before the first timed refit (a client opened per refit put the
        connection's setup, ~0.5 ms on a 2-core VM, inside every trigger -> COMMITTED)."""
        from refitplane.client import RefitClient
        from refitplane.errors import RefitError

        if self._client is None:
            self._client = RefitClient(self.coordinator.grpc_target, timeout_s=60)
            with contextlib.suppress(RefitError):  # connects (NOT_FOUND before any member)
                self._client.list(self.job, limit=1)
        return self._client

    def rank_seconds(self) -> dict[str, dict[str, float]]:
        """Per data-plane rank ("trainer-0", "replica-0/0", ...), from its last refit: its
        executor's wall time ("executor": what of the coordinator's TRANSFERRING the data
        plane took) and its parts (`worker_probes.report_seconds`), and in vLLM workers the
        engine's finish_weight_update ("finish")."""
        from refitplane.testing.refit_world.worker_probes import (
            last_refit_seconds,
            report_seconds,
        )

        out: dict[str, dict[str, float]] = {}
        for r in range(self.trainer_ranks):
            report = self.ask(f"trainer-{r}", "report", "report")
            out[f"trainer-{r}"] = report_seconds(report)
        for name in self.replicas():
            ranks = self.ask(name, ("rpc", (last_refit_seconds, [])), "rpc")
            out.update({f"{name}/{k}": dict(seconds) for k, seconds in enumerate(ranks)})
        return out

    def trainer_peak_memory(self) -> list[int]:
        return [self.ask(f"trainer-{r}", "mem", "mem") for r in range(self.trainer_ranks)]

    def stop(self) -> None:
        for name, q in self._queues.items():
            with contextlib.suppress(Exception):
                q.put(("stop", None) if name.startswith("replica-") else "stop")
        for p in self._procs:
            stop_process(p)
        self._procs.clear()
        self._queues.clear()
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.coordinator is not None:
            self.coordinator.stop()
            self.coordinator = None


@contextlib.contextmanager
def refit_world(**kwargs: Any) -> Iterator[World]:
    load_format = kwargs.pop("load_format", "dummy")
    model_dir = kwargs.pop("model_dir", None)
    world = World(**kwargs)
    try:
        yield world.start(load_format=load_format, model_dir=model_dir)
    finally:
        world.stop()
