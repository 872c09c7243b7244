#!/usr/bin/env python3
"""Control overhead per refit: what a refit costs besides moving bytes, by model shape.

    python benchmarks/control_overhead.py                         # every shape, default ranks
    python benchmarks/control_overhead.py --shapes qwen3-30b-a3b --refits 50 --json out.json

For each shape (Qwen3-8B: 399 tensors, Qwen3-30B-A3B: 18,867, DeepSeek-V3 in FP8: 90,427)
this runs the real coordinator as a process (`python -m refitplane.coordinator`) on Redis
(a `redis-server` started here), and one process per trainer and generator rank, each a
real `AgentSession` publishing that rank's layout of the shape (specs and boxes only: no
tensor memory) with a simulated data plane (`refitplane.agent.simulated`: transfers end at
once), so the refit's TRANSFERRING phase is nearly empty and everything else is control.

The first refit of a layout (planning, group formation, every rank's plan body) is reported
on its own; then `--warmup` refits, then `--refits` steady ones, from which the p50 and p95 of
each phase come (the coordinator's own per-phase timings of every refit record). It prints a
table, then one line per shape:

    shape=<name> tensors=<n> prepare_ms=<p50> verify_ms=<p50>

and exits 1 when any shape's PREPARING or VERIFYING p50 is above --limit-ms (20). Ranks are
far fewer than production (256 trainer → 128 generator ranks for DeepSeek-V3 would be 384
processes on this machine): every shape keeps its full tensor count, and the table says
which ranks ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a script (`python benchmarks/control_overhead.py`): its folder is sys.path[0], so the
# sibling benchmarks import as top-level modules.
from control_plane import coordinator, redis_server
from planner_scale import layer_tensors as deepseek_layer_tensors

from refitplane.client import RefitClient
from refitplane.protocol import RefitState, Role
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.placements import chunk_range

# --- shapes: (spec, split) per tensor, split in col / row / rep / expert:<e> -------------------

Split = tuple[TensorSpec, str]


def _qwen3_attention(p: str, hidden: int, heads: int, kv_heads: int) -> Iterator[Split]:
    head = 128
    yield (
        TensorSpec.create(f"{p}.self_attn.q_proj.weight", [heads * head, hidden], "bfloat16"),
        "col",
    )
    for kv in ("k", "v"):
        yield (
            TensorSpec.create(
                f"{p}.self_attn.{kv}_proj.weight", [kv_heads * head, hidden], "bfloat16"
            ),
            "col",
        )
    yield (
        TensorSpec.create(f"{p}.self_attn.o_proj.weight", [hidden, heads * head], "bfloat16"),
        "row",
    )
    for norm in ("self_attn.q_norm", "self_attn.k_norm"):
        yield TensorSpec.create(f"{p}.{norm}.weight", [head], "bfloat16"), "rep"
    for norm in ("input_layernorm", "post_attention_layernorm"):
        yield TensorSpec.create(f"{p}.{norm}.weight", [hidden], "bfloat16"), "rep"


def _qwen3_outer(hidden: int, vocab: int) -> Iterator[Split]:
    yield TensorSpec.create("model.embed_tokens.weight", [vocab, hidden], "bfloat16"), "col"
    yield TensorSpec.create("lm_head.weight", [vocab, hidden], "bfloat16"), "col"
    yield TensorSpec.create("model.norm.weight", [hidden], "bfloat16"), "rep"


def qwen3_8b() -> Iterator[Split]:
    hidden, inter = 4096, 12288
    for layer in range(36):
        p = f"model.layers.{layer}"
        yield from _qwen3_attention(p, hidden, 32, 8)
        for proj, shape, split in (
            ("gate", [inter, hidden], "col"),
            ("up", [inter, hidden], "col"),
            ("down", [hidden, inter], "row"),
        ):
            yield TensorSpec.create(f"{p}.mlp.{proj}_proj.weight", shape, "bfloat16"), split
    yield from _qwen3_outer(hidden, 151936)


def qwen3_30b_a3b() -> Iterator[Split]:
    hidden, inter, experts = 2048, 768, 128
    for layer in range(48):
        p = f"model.layers.{layer}"
        yield from _qwen3_attention(p, hidden, 32, 4)
        yield TensorSpec.create(f"{p}.mlp.gate.weight", [experts, hidden], "bfloat16"), "rep"
        for e in range(experts):
            for proj, shape in (
                ("gate", [inter, hidden]),
                ("up", [inter, hidden]),
                ("down", [hidden, inter]),
            ):
                spec = TensorSpec.create(
                    f"{p}.mlp.experts.{e}.{proj}_proj.weight", shape, "bfloat16"
                )
                yield spec, f"expert:{e}"
    yield from _qwen3_outer(hidden, 151936)


def deepseek_v3() -> Iterator[Split]:
    for layer in range(61):
        yield from deepseek_layer_tensors(layer, 256)
    yield TensorSpec.create("model.embed_tokens.weight", [129280, 7168], "bfloat16"), "col"
    yield TensorSpec.create("lm_head.weight", [129280, 7168], "bfloat16"), "col"
    yield TensorSpec.create("model.norm.weight", [7168], "bfloat16"), "rep"


SHAPES = {"qwen3-8b": qwen3_8b, "qwen3-30b-a3b": qwen3_30b_a3b, "deepseek-v3": deepseek_v3}
# trainer ranks, generator replicas, generator ranks per replica
DEFAULT_RANKS = {"qwen3-8b": (2, 1, 2), "qwen3-30b-a3b": (2, 1, 2), "deepseek-v3": (8, 1, 8)}


def rank_layout(shape: str, rank: int, world: int) -> Layout:
    """What `rank` of `world` holds (trainer) or needs (generator): dense weights tensor-
    parallel over the ranks (column / row splits, norms replicated), expert e on rank
    e mod world."""
    b = LayoutBuilder()
    for spec, split in SHAPES[shape]():
        full = [(0, n) for n in spec.shape]
        if split.startswith("expert:"):
            if int(split.split(":")[1]) % world != rank:
                continue
        elif split == "col" or (split == "row" and len(spec.shape) == 2):
            dim = 0 if split == "col" else 1
            lo, hi = chunk_range(spec.shape[dim], world, rank)
            if hi <= lo:
                continue
            full[dim] = (lo, hi)
        b.add(spec, rank, tuple(full))
    return b.build()


# --- agent processes ----------------------------------------------------------------------------


def serve_simulated_rank(args: argparse.Namespace, layout: Layout, behaviour: Any = None) -> int:
    """One simulated rank (`args`: role, rank, world, replica, coordinator, job): register,
    publish `layout`, answer every command (`Behaviour` knobs) until SIGTERM."""
    from refitplane.agent import AgentSession, MemberInfo
    from refitplane.agent.simulated import SimulatedAgent

    role = Role.TRAINER if args.role == "trainer" else Role.GENERATOR
    handler = SimulatedAgent(role, behaviour)
    info = MemberInfo(
        job=args.job, role=role, rank=args.rank, world_size=args.world,
        replica_id=args.replica, host="127.0.0.1", device="cpu",
    )  # fmt: skip
    session = AgentSession(args.coordinator, info, handler, timeout_s=60)
    handler.session = session
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    with session:
        session.publish_layout(layout)
        while not stop[0]:
            time.sleep(0.1)
    return 0


def agent_main(args: argparse.Namespace) -> int:
    """One rank of a shape: its layout, every command answered at once."""
    return serve_simulated_rank(args, rank_layout(args.shape, args.rank, args.world))


@dataclass
class Ranks:
    trainers: int
    replicas: int
    gen_tp: int

    def describe(self) -> str:
        return f"{self.trainers} trainer -> {self.replicas}x{self.gen_tp} generator"

    @property
    def total(self) -> int:
        return self.trainers + self.replicas * self.gen_tp


RankSpec = tuple[str, int, int, str]  # role, rank, world, replica


@contextlib.contextmanager
def rank_processes(
    script: str,
    specs: list[RankSpec],
    target: str,
    job: str,
    *extra: str,
    keep_env: tuple[str, ...] = (),
) -> Iterator[None]:
    """One `script agent ...` process per rank spec (plus `extra` arguments), ended at exit.
    REFIT_* variables stay out of their environment (`keep_env`: prefixes kept anyway)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("REFIT_") or (keep_env and k.startswith(keep_env))
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for role, rank, world, replica in specs:
            cmd = [sys.executable, script, "agent", "--role", role, "--rank", str(rank),
                   "--world", str(world), "--replica", replica, "--coordinator", target,
                   "--job", job, *extra]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def agents(
    target: str, job: str, shape: str, ranks: Ranks
) -> contextlib.AbstractContextManager[None]:
    specs: list[RankSpec] = [("trainer", r, ranks.trainers, "") for r in range(ranks.trainers)]
    specs += [
        ("generator", r, ranks.gen_tp, f"replica-{i}")
        for i in range(ranks.replicas)
        for r in range(ranks.gen_tp)
    ]
    return rank_processes(str(Path(__file__).resolve()), specs, target, job, "--shape", shape)


def wait_published(client: RefitClient, job: str, members: int, timeout_s: float) -> float:
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        with contextlib.suppress(Exception):
            topo = client.topology(job)
            if sum(1 for m in topo.members if m.layout_digest) >= members:
                return time.monotonic() - started
        if time.monotonic() > deadline:
            raise RuntimeError(f"{job}: {members} members did not publish within {timeout_s:g} s")
        time.sleep(0.2)


# --- measuring ----------------------------------------------------------------------------------

PHASES = (RefitState.PENDING, RefitState.PREPARING, RefitState.TRANSFERRING, RefitState.VERIFYING)


def _phases_ms(refit: object) -> dict[str, float]:
    timings = {t.phase: t.seconds for t in refit.timings}  # type: ignore[attr-defined]
    out = {p.value: timings.get(p, 0.0) * 1e3 for p in PHASES}
    total = (refit.updated_unix - refit.created_unix) * 1e3  # type: ignore[attr-defined]
    out["total"] = total
    out["overhead"] = total - out[RefitState.TRANSFERRING.value]
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def measure(shape: str, ranks: Ranks, args: argparse.Namespace) -> dict[str, object]:
    job = f"overhead-{shape}"
    tensors = sum(1 for _ in SHAPES[shape]())
    with (
        redis_server() as url,
        coordinator(url, lease_ttl_s=60.0) as target,
        agents(target, job, shape, ranks),
        RefitClient(target, timeout_s=120) as client,
    ):
        publish_s = wait_published(client, job, ranks.total, args.start_timeout_s)

        def refit(i: int) -> dict[str, float]:
            done = client.wait(client.trigger(job, idempotency_key=f"r{i}").refit_id, timeout_s=600)
            if done.state is not RefitState.COMMITTED:
                raise RuntimeError(
                    f"{shape}: refit {i} {done.state.value}: {done.reason}: {done.message}"
                )
            return _phases_ms(done)

        first = refit(0)
        for i in range(args.warmup):
            refit(1 + i)
        steady = [refit(1 + args.warmup + i) for i in range(args.refits)]
    keys = [*(p.value for p in PHASES), "total", "overhead"]
    return {
        "shape": shape,
        "tensors": tensors,
        "ranks": ranks.describe(),
        "publish_s": publish_s,
        "first": first,
        "p50": {k: _pct([s[k] for s in steady], 50) for k in keys},
        "p95": {k: _pct([s[k] for s in steady], 95) for k in keys},
        "refits": len(steady),
    }


def render(results: list[dict[str, object]]) -> str:
    cols = ["PENDING", "PREPARING", "TRANSFERRING", "VERIFYING", "total", "overhead"]
    head = f"{'shape':<14} {'tensors':>7}  {'ranks':<28} {'refit':<12}" + "".join(
        f"{c:>13}" for c in cols
    )
    lines = [head + "   (ms; overhead = total - TRANSFERRING)"]
    for r in results:
        for label, key in (("first", "first"), ("steady p50", "p50"), ("steady p95", "p95")):
            row = r[key]
            assert isinstance(row, dict)
            lines.append(
                f"{r['shape']:<14} {r['tensors']:>7}  {r['ranks']:<28} {label:<12}"
                + "".join(f"{row[c]:>13.2f}" for c in cols)
            )
    return "\n".join(lines)


def parse_ranks(values: list[str]) -> dict[str, Ranks]:
    out = {name: Ranks(*r) for name, r in DEFAULT_RANKS.items()}
    for value in values:
        name, _, spec = value.partition("=")
        t, rep, g = (int(x) for x in spec.split("x"))
        out[name] = Ranks(t, rep, g)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "agent":
        p = argparse.ArgumentParser()
        p.add_argument("agent")
        for flag in ("--shape", "--role", "--replica", "--coordinator", "--job"):
            p.add_argument(flag, default="")
        p.add_argument("--rank", type=int, default=0)
        p.add_argument("--world", type=int, default=1)
        return agent_main(p.parse_args())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--refits", type=int, default=20, help="steady refits measured per shape")
    p.add_argument("--warmup", type=int, default=2, help="refits after the first, not measured")
    p.add_argument(
        "--ranks", action="append", default=[],
        help="SHAPE=TxRxG: T trainer ranks, R generator replicas of G ranks (e.g. deepseek-v3=8x1x8)",
    )  # fmt: skip
    p.add_argument(
        "--limit-ms", type=float, default=20.0, help="fail above this PREPARING/VERIFYING p50"
    )
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--json", help="write the results here as JSON")
    args = p.parse_args()
    ranks = parse_ranks(args.ranks)
    results = [measure(shape, ranks[shape], args) for shape in args.shapes.split(",")]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"coordinator on Redis, one process per rank, simulated data plane"
    )
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    failed = False
    for r in results:
        p50 = r["p50"]
        assert isinstance(p50, dict)
        prepare, verify = p50["PREPARING"], p50["VERIFYING"]
        print(
            f"shape={r['shape']} tensors={r['tensors']} prepare_ms={prepare:.2f} verify_ms={verify:.2f}"
        )
        failed |= prepare > args.limit_ms or verify > args.limit_ms
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
