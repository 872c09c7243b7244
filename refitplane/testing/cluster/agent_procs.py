"""Run one trainer rank or one generator rank as its own process, for tests that kill,
stall, freeze or restart agents.

    python -m refitplane.testing.cluster.agent_procs trainer   --coordinator H:P --job J --rank R --world W \\
        --control-file F [--version V]
    python -m refitplane.testing.cluster.agent_procs generator --coordinator H:P --job J --replica REP \\
        --rank R --world W --control-file F [--version V]

A trainer is a real `TrainerAgent` holding its tensor-parallel share of
`synthetic_state(version)` (or of a Hugging Face checkpoint directory, `--checkpoint`); a generator is a real `ReferenceEngine` starting from its share of
`synthetic_state(version)` (default 0). Both use the production data plane (Gloo), with
`faulty_transport` installed so a test can arm faults. Once registered and published, the
process serves a small control API on loopback and writes `{"port", "pid", "member_id"}` to
the control file:

    GET  /status   what it holds and did: member id, registrations, group epoch, transfers,
                   every transfer outcome (ok, weights_modified), version / ready (generator),
                   step / weights guard (trainer), sha256 digests of every tensor it holds,
                   fault counters (communicators created / aborted / open), threads, fds, RSS
    POST /faults   arm faults: {"stall_after_bytes": N, "stall_until": "deadline"|"abort",
                   "corrupt_sends": 1, "delay_s": D, "hold": true, "misreport_done": 1}
                   (see `faulty_transport`)
    POST /faults/release  let the transfer held by "hold" go on
    POST /step     trainer: a "training step" to {"version": V} inside
                   `agent.updating_weights()` (waits for a refit reading the weights);
                   "hold_s": keep the weights locked that long (a slow optimizer step)
    POST /serve    generator: what a generation would read, inside `engine.serving()`:
                   200 {"version", "digests"}, or 409 when the engine refuses to serve
    POST /stop     close the agent (deregister) and exit 0 (SIGTERM does the same)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from refitplane.http_json import JsonRequestHandler
from refitplane.lifecycle import stop_event_on_signals

log = logging.getLogger("refitplane.testing.cluster.agent_procs")

# Outcomes kept in the status (newest last).
_OUTCOMES_KEPT = 50


@dataclass(frozen=True)
class Outcome:
    refit_id: str
    version: int
    ok: bool
    weights_modified: bool
    unix: float


class AgentRunner:
    """The agent of this process and what the control API reads and does."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from refitplane.testing.cluster import faulty_transport
        from refitplane.testing.cluster.synthetic_state import rank_shards, synthetic_specs

        torch.set_num_threads(1)
        self.args = args
        self.role: str = args.role
        self.faults = faulty_transport.Faults()
        faulty_transport.install(self.faults)
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self.step_version = args.version
        token = _read_token(args.token_file)
        tls_ca = args.tls_ca or None
        self.agent: Any
        if self.role == "trainer":
            from refitplane.trainer.agent import TrainerAgent

            if args.checkpoint:
                self.shards = _checkpoint_shards(args.checkpoint, args.rank, args.world)
            else:
                self.shards = rank_shards(args.version, args.rank, args.world, scale=args.scale)
            self.agent = TrainerAgent(
                coordinator=args.coordinator,
                job=args.job,
                rank=args.rank,
                world_size=args.world,
                shards=self.shards,
                host="127.0.0.1",
                token=token,
                tls_ca=tls_ca,
            )
        else:
            from refitplane.generator.reference_engine import ReferenceEngine
            from refitplane.testing.cluster.synthetic_state import synthetic_state

            self.agent = ReferenceEngine(
                coordinator=args.coordinator,
                job=args.job,
                replica_id=args.replica,
                rank=args.rank,
                world_size=args.world,
                specs=synthetic_specs(scale=args.scale),
                initial=synthetic_state(args.version, scale=args.scale),
                token=token,
                tls_ca=tls_ca,
                version=args.version,
            )
            self.shards = self.agent.shards
        self._watch_outcomes()
        self._misreport_when_armed()

    def _misreport_when_armed(self) -> None:
        """An armed `misreport_done` replaces the next TransferDone by one that claims
        nothing moved (the member's own session and credential: a lying agent, not a
        forger)."""
        session = self.agent.session
        report: Callable[..., bool] = session.report_transfer_done

        def report_transfer_done(refit_id: str, **fields: Any) -> bool:
            if self.faults.take_misreport():
                fields |= {
                    "bytes_sent": 0,
                    "bytes_received": 0,
                    "tensors_verified": 0,
                    "tensors_total": 0,
                    "bytes_full": 0,
                }
            return report(refit_id, **fields)

        session.report_transfer_done = report_transfer_done

    def _watch_outcomes(self) -> None:
        """Record every transfer's end through the member's `after_transfer` hook."""
        member = self.agent.member
        hook: Callable[..., None] = member.after_transfer

        def after_transfer(prepared: Any, report: Any, *, weights_modified: bool) -> None:
            hook(prepared, report, weights_modified=weights_modified)
            outcome = Outcome(
                prepared.refit_id,
                prepared.version,
                report is not None,
                weights_modified,
                time.time(),
            )
            with self._lock:
                self.outcomes = [*self.outcomes[-(_OUTCOMES_KEPT - 1) :], outcome]

        member.after_transfer = after_transfer

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self.agent.start()

    def close(self) -> None:
        self.agent.close()

    # -- control API ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        from refitplane.testing.cluster.synthetic_state import shard_digests

        member = self.agent.member
        session = self.agent.session
        with self._lock:
            outcomes = [o.__dict__ for o in self.outcomes]
        out: dict[str, Any] = {
            "role": self.role,
            "rank": self.args.rank,
            "world": self.args.world,
            "scale": self.args.scale,
            "replica": self.args.replica,
            "pid": os.getpid(),
            "member_id": session.member_id,
            "registrations": session.registrations,
            "epoch": member.epoch,
            "has_transport": member.transport is not None,
            "transfers": member.transfers,
            "outcomes": outcomes,
            "digests": shard_digests(self.shards),
            "faults": self.faults.snapshot(),
            **process_resources(),
        }
        if self.role == "trainer":
            out |= {"step": self.step_version, "guard_held": self.agent.guard.held}
        else:
            out |= {"version": self.agent.version, "ready": self.agent.ready}
        return out

    def step(
        self, version: int, timeout_s: float, hold_s: float = 0.0
    ) -> tuple[int, dict[str, Any]]:
        from refitplane.testing.cluster.synthetic_state import load_state_into, synthetic_state

        if self.role != "trainer":
            return 400, {"error": "only trainers take training steps"}
        state = synthetic_state(version, scale=self.args.scale)
        started = time.monotonic()

        def run() -> None:
            with self.agent.updating_weights():
                load_state_into(self.shards, state)
                self.step_version = version
                # A long optimizer step: refits wait for it (bounded by their timeouts).
                time.sleep(hold_s)

        ok = _within(run, timeout_s)
        waited = time.monotonic() - started
        if not ok:
            return 504, {"error": f"the weights guard was still held after {timeout_s} s"}
        return 200, {"version": version, "waited_s": waited}

    def serve(self, timeout_s: float) -> tuple[int, dict[str, Any]]:
        from refitplane.errors import FailedPrecondition
        from refitplane.testing.cluster.synthetic_state import shard_digests

        if self.role != "generator":
            return 400, {"error": "only generators serve"}
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                with self.agent.serving():
                    result.update(
                        served=True, version=self.agent.version, digests=shard_digests(self.shards)
                    )
            except FailedPrecondition as exc:
                result.update(served=False, error=exc.message)

        if not _within(run, timeout_s):
            return 504, {"served": False, "error": f"still paused after {timeout_s} s"}
        return (200 if result.get("served") else 409), result


def _checkpoint_shards(path: str, rank: int, world: int) -> Any:
    """This rank's tensor-parallel share of a Hugging Face checkpoint directory."""
    import torch

    from refitplane.generator.reference_engine import shard_state, specs_of
    from refitplane.models.tiny import load_checkpoint

    state = load_checkpoint(path)
    return shard_state(specs_of(state), rank, world, torch.device("cpu"), state)


def _within(fn: Callable[[], None], timeout_s: float) -> bool:
    """Run `fn` on its own thread; whether it finished within `timeout_s` (an unfinished
    call keeps its thread until it returns: the agent bounds every wait it does)."""
    thread = threading.Thread(target=fn, name="agent-control", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def process_resources(pid: int | str = "self") -> dict[str, int]:
    """Threads, open file descriptors and resident memory (KiB) of a process (Linux /proc)."""
    base = Path("/proc") / str(pid)
    threads = fds = rss_kb = 0
    try:
        for line in (base / "status").read_text().splitlines():
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
        fds = len(os.listdir(base / "fd"))
    except OSError:
        pass
    if pid == "self" and not rss_kb:
        rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"threads": threads, "fds": fds, "rss_kb": rss_kb}


def _read_token(path: str) -> str | None:
    if not path:
        return None
    return Path(path).read_text().strip() or None


class _ControlHandler(JsonRequestHandler):
    log_name = "control"
    log = log
    runner: AgentRunner
    stop: threading.Event

    def do_GET(self) -> None:
        if self.path == "/status":
            self._reply(200, self.runner.status())
        else:
            self._reply(404, {"error": f"no route GET {self.path}"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self._reply(400, {"error": "body is not JSON"})
            return
        timeout_s = float(body.get("timeout_s", 30.0))
        if self.path == "/faults":
            from refitplane.errors import InvalidArgument

            try:
                self.runner.faults.arm(
                    stall_after_bytes=body.get("stall_after_bytes"),
                    stall_until=str(body.get("stall_until", "deadline")),
                    corrupt_sends=int(body.get("corrupt_sends", 0)),
                    delay_s=float(body.get("delay_s", 0.0)),
                    hold=bool(body.get("hold", False)),
                    misreport_done=int(body.get("misreport_done", 0)),
                )
            except InvalidArgument as exc:
                self._reply(400, {"error": exc.message})
                return
            self._reply(200, self.runner.faults.snapshot())
        elif self.path == "/faults/release":
            self.runner.faults.release()
            self._reply(200, self.runner.faults.snapshot())
        elif self.path == "/step":
            hold_s = float(body.get("hold_s", 0.0))
            self._reply(*self.runner.step(int(body["version"]), timeout_s, hold_s))
        elif self.path == "/serve":
            self._reply(*self.runner.serve(timeout_s))
        elif self.path == "/stop":
            self._reply(200, {"stopping": True})
            self.stop.set()
        else:
            self._reply(404, {"error": f"no route POST {self.path}"})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agent_procs", description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["trainer", "generator"])
    p.add_argument("--coordinator", required=True, help="gRPC host:port")
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True, help="trainer ranks / replica TP size")
    p.add_argument("--replica", default="", help="generator replica id")
    p.add_argument("--version", type=int, default=0, help="weights held at start")
    p.add_argument("--scale", type=int, default=1, help="embedding rows = 256 * scale")
    p.add_argument(
        "--checkpoint", default="", help="trainer: hold this HF checkpoint's TP share instead"
    )
    p.add_argument("--control-file", type=Path, required=True)
    p.add_argument("--token-file", default="")
    p.add_argument("--tls-ca", default="")
    p.add_argument("--log-level", default="WARNING")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.role == "generator" and not args.replica:
        print("agent_procs: a generator needs --replica", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = stop_event_on_signals(log)  # SIGTERM / SIGINT, logged
    runner = AgentRunner(args)
    runner.start()
    handler = type("Control", (_ControlHandler,), {"runner": runner, "stop": stop})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="agent-control-http", daemon=True).start()
    info = {"port": server.server_address[1], "pid": os.getpid(), "member_id": ""}
    info["member_id"] = runner.agent.session.member_id
    tmp = args.control_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(args.control_file)
    try:
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        runner.close()
    return 0


def exit_without_finalizing(code: int) -> None:
    """Exit once the agent has stopped (deregistered, transport closed), skipping the
    interpreter's finalization: with torch imported that is seconds of CPU and no system
    call (1.4-7 s on the shared 2-core box, by its load; strace shows nothing between the
    last write and exit_group), and a stopped rank has nothing left to release. Every test
    that stops or restarts a rank waited for it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_finalizing(main())
