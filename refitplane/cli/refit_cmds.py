"""`refitctl trigger | status | list | cancel | topology`: operate refits over gRPC.

The coordinator comes from --coordinator or REFIT_COORDINATOR (host:port), the token from
--token, REFIT_AUTH_TOKEN or REFIT_AUTH_TOKEN_FILE, a CA bundle for TLS from --tls-ca or
REFIT_TLS_CA_FILE, the job from --job or REFIT_JOB. `--json` prints the records as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

from refitplane.cli.args import non_negative_int, positive_float, positive_int
from refitplane.cli.connect import open_client
from refitplane.cli.exits import EXIT_OK, EXIT_REFIT_FAILED
from refitplane.errors import InvalidArgument, TransferTimeout
from refitplane.protocol.models import Refit, Topology


def register(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--coordinator", help="gRPC host:port (REFIT_COORDINATOR)")
    common.add_argument("--token", help="bearer token (REFIT_AUTH_TOKEN / REFIT_AUTH_TOKEN_FILE)")
    common.add_argument("--tls-ca", help="CA bundle of a TLS coordinator (REFIT_TLS_CA_FILE)")
    common.add_argument(
        "--timeout", type=positive_float, default=10.0, help="per-call timeout, seconds"
    )
    common.add_argument("--json", action="store_true", help="print JSON (errors too, on stderr)")

    p = sub.add_parser("trigger", parents=[common], help="start a refit of a job's generators")
    p.add_argument("--job", help="job name (REFIT_JOB)")
    p.add_argument(
        "--replica", action="append", default=[], help="replica to update (repeat; default all)"
    )
    p.add_argument("--key", default="", help="idempotency key: the same key, the same refit")
    p.add_argument(
        "--version", type=non_negative_int, default=0, help="weight version (default: the next)"
    )
    p.add_argument("--watch", action="store_true", help="then show progress until it ends")
    p.add_argument(
        "--watch-timeout", type=positive_float, default=3600.0, help="seconds (default 3600)"
    )
    p.set_defaults(handler=_trigger)

    p = sub.add_parser("status", parents=[common], help="show a refit (--watch: live progress)")
    p.add_argument("refit_id")
    p.add_argument("--watch", action="store_true", help="follow it until committed or failed")
    p.add_argument(
        "--watch-timeout", type=positive_float, default=3600.0, help="seconds (default 3600)"
    )
    p.set_defaults(handler=_status)

    p = sub.add_parser("list", parents=[common], help="list a job's refits, newest first")
    p.add_argument("--job", help="job name (REFIT_JOB)")
    p.add_argument("--limit", type=positive_int, default=20, help="at most this many (default 20)")
    p.set_defaults(handler=_list)

    p = sub.add_parser("cancel", parents=[common], help="cancel a refit (until committed)")
    p.add_argument("refit_id")
    p.set_defaults(handler=_cancel)

    p = sub.add_parser("topology", parents=[common], help="a job's members, replicas, group")
    p.add_argument("--job", help="job name (REFIT_JOB)")
    p.set_defaults(handler=_topology)


# --- plumbing -------------------------------------------------------------------------------


def _job(args: argparse.Namespace) -> str:
    from refitplane.client import ClientSettings

    job = args.job or ClientSettings().job
    if not job:
        raise InvalidArgument("give --job or set REFIT_JOB", field="job")
    return str(job)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _ago(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix)) if unix else "-"


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain, aligned text table."""
    cells = [list(map(str, headers)), *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _describe(refit: Refit) -> str:
    lines = [
        f"refit     {refit.refit_id}",
        f"job       {refit.job}",
        f"version   {refit.version}",
        f"state     {refit.state.value}",
        f"replicas  {', '.join(refit.target_replicas) or '(all)'}",
        f"progress  {_human_bytes(refit.bytes_done)} / {_human_bytes(refit.bytes_total)}",
        f"tensors   {refit.tensors_verified} / {refit.tensors_total} verified",
        *_paths(refit),
        f"epoch     {refit.group_epoch}",
        f"created   {_ago(refit.created_unix)}",
    ]
    if refit.coalesced:
        lines.append(f"coalesced {refit.coalesced} trigger(s)")
    if refit.timings:
        lines.append(
            "timings   " + ", ".join(f"{t.phase.value} {t.seconds:.3f}s" for t in refit.timings)
        )
    if refit.reason:
        lines.append(f"reason    {refit.reason}: {refit.message}")
    return "\n".join(lines)


def _paths(refit: Refit) -> list[str]:
    """Which replicas took a delta and which went in full, and the bytes on the wire."""
    if not refit.bytes_on_wire and not refit.delta_replicas:
        return []
    full = [r for r in refit.target_replicas if r not in refit.delta_replicas]
    return [
        f"delta     {', '.join(refit.delta_replicas) or '-'}; full: {', '.join(full) or '-'}",
        f"wire      {_human_bytes(refit.bytes_on_wire)} of {_human_bytes(refit.bytes_total)}",
    ]


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


# --- progress ---------------------------------------------------------------------------------

_BAR = 30


def progress_line(refit: Refit) -> str:
    """`[#####.....]  42%  1.2 GiB / 2.9 GiB  TRANSFERRING` — one line of live progress."""
    fraction = 1.0 if refit.state.value == "COMMITTED" else refit.fraction_done
    filled = round(fraction * _BAR)
    return (
        f"[{'#' * filled}{'.' * (_BAR - filled)}] {fraction * 100:5.1f}%  "
        f"{_human_bytes(refit.bytes_done)} / {_human_bytes(refit.bytes_total)}  "
        f"{refit.state.value}"
    )


def watch(client: Any, refit_id: str, *, timeout_s: float, out: TextIO) -> Refit:
    """Follow a refit: redraw one progress line on a terminal, print each change otherwise."""
    live = out.isatty()
    last: Refit | None = None
    previous = ""
    try:
        for refit in client.watch(refit_id, timeout_s=timeout_s):
            line = progress_line(refit)
            if live:
                out.write("\r" + line.ljust(len(previous)))
            elif line != previous:
                out.write(line + "\n")
            out.flush()
            previous, last = line, refit
    finally:
        if live:
            out.write("\n")
            out.flush()
    if last is None:
        raise TransferTimeout(f"no update for refit {refit_id}", field="refit_id")
    return last


def _finish(args: argparse.Namespace, refit: Refit) -> int:
    if args.json:
        _print_json(refit.model_dump(mode="json"))
    else:
        print(_describe(refit))
    failed = refit.state.value in ("FAILED", "CANCELLED")
    return EXIT_REFIT_FAILED if failed else EXIT_OK


def _follow(args: argparse.Namespace, client: Any, refit: Refit) -> int:
    final = watch(client, refit.refit_id, timeout_s=args.watch_timeout, out=sys.stderr)
    return _finish(args, final)


# --- subcommands ------------------------------------------------------------------------------


def _trigger(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        refit = client.trigger(
            _job(args), target_replicas=args.replica, idempotency_key=args.key, version=args.version
        )
        if args.watch:
            return _follow(args, client, refit)
        return _finish(args, refit)


def _status(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        refit = client.get(args.refit_id)
        if args.watch:
            return _follow(args, client, refit)
        return _finish(args, refit)


def _list(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        refits = client.list(_job(args), limit=args.limit)
    if args.json:
        _print_json([r.model_dump(mode="json") for r in refits])
        return 0
    rows = [
        (
            r.refit_id,
            r.version,
            r.state.value,
            ",".join(r.target_replicas) or "(all)",
            _human_bytes(r.bytes_total),
            f"{sum(t.seconds for t in r.timings):.2f}s",
            _ago(r.created_unix),
            r.reason,
        )
        for r in refits
    ]
    print(
        table(("REFIT", "VERSION", "STATE", "REPLICAS", "BYTES", "TIME", "CREATED", "REASON"), rows)
    )
    return 0


def _cancel(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        refit = client.cancel(args.refit_id)
    if args.json:
        _print_json(refit.model_dump(mode="json"))
    else:
        print(f"refit {refit.refit_id}: {refit.state.value}")
    return 0


def topology_text(topo: Topology) -> str:
    group = (
        f"group epoch {topo.group_epoch}, {topo.group_size} ranks, {topo.backend.value}"
        if topo.backend is not None and topo.group_size
        else f"no group (epoch {topo.group_epoch})"
    )
    head = (
        f"job {topo.job}: committed version {topo.committed_version}, {group}, "
        f"{'healthy' if topo.healthy else 'NOT healthy'}"
    )
    replicas = table(
        ("REPLICA", "VERSION", "STATE", "WORLD", "MEMBERS"),
        [
            (r.replica_id, r.version, r.state.value, r.world_size, len(r.member_ids))
            for r in topo.replicas
        ],
    )
    members = table(
        (
            "ROLE",
            "REPLICA",
            "RANK",
            "GROUP",
            "STATE",
            "DEVICE",
            "HOST",
            "NODE",
            "GPU",
            "VERSION",
            "RECEIVE",
            "DELTA",
            "MEMBER",
        ),
        [
            (
                m.role.value,
                m.replica_id or "-",
                f"{m.rank}/{m.world_size}",
                m.group_rank if m.group_rank >= 0 else "-",
                m.state.value,
                m.device or "-",
                m.host or "-",
                m.node or "-",
                # Enough of the UUID to tell GPUs apart; a shared one means CUDA IPC.
                m.device_uuid[:12] or "-",
                m.version if m.role.value != "TRAINER" else "-",
                _receive_paths(m.labels),
                _delta_path(m.labels),
                m.member_id,
            )
            for m in topo.members
        ],
    )
    return f"{head}\n\n{replicas}\n\n{members}"


def _receive_paths(labels: Mapping[str, str]) -> str:
    """How a vLLM rank receives (its engine's labels): "staged: 10 fast + 2 fallback"."""
    mode = labels.get("receive_mode")
    if not mode:
        return "-"
    fast, fallback = labels.get("fast_tensors", "?"), labels.get("fallback_tensors", "0")
    moved = labels.get("rules_moved", "")
    checked = f"; rules moved to fallback at start: {moved}" if moved else ""
    return f"{mode}: {fast} fast + {fallback} fallback{checked}"


def _delta_path(labels: Mapping[str, str]) -> str:
    """A rank's part in delta refits: a trainer's snapshot (placement and its memory, one
    copy of its shards, held while REFIT_DELTA is auto or on), a generator's receive."""
    placement = labels.get("delta_snapshot")
    if placement:
        size = labels.get("delta_snapshot_bytes", "")
        return f"snapshot {placement} {_human_bytes(int(size))}" if size.isdigit() else placement
    receive = labels.get("delta_receive")
    if receive:
        return "in place" if receive == "yes" else "full only"
    return "-"


def _topology(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        topo = client.topology(_job(args))
    if args.json:
        _print_json(topo.model_dump(mode="json"))
    else:
        print(topology_text(topo))
    return 0
