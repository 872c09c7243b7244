"""`refitctl plan`: a dry run of the planner on two layout files.

Validates both layouts, plans, and prints totals, bytes per link and per rank, imbalance
and the plan hash (or all of it as JSON). Source and target ranks are separate namespaces
in the files; the plan is computed over group ranks (targets after sources) and printed
back in each side's own numbering.

With `--placement FILE` (where each rank runs, as members register it:
{"source": [{"device": "cuda:0", "node": "n1", "gpu": "GPU-..."}, ...], "target": [...]},
one entry per rank) it also shows the transport the coordinator would choose: per link,
and the one the group runs (CUDA IPC when every link stays on one node and IPC serves it;
`--same-host-transport` as REFIT_SAME_HOST_TRANSPORT).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from refitplane.cli.args import non_negative_int
from refitplane.errors import InvalidArgument, LayoutError
from refitplane.protocol.links import SAME_HOST_CHOICES, Placement, SameHost, group_transports
from refitplane.reshard.layout import Layout
from refitplane.reshard.layout_json import load_layout
from refitplane.reshard.plan import PlanStats
from refitplane.reshard.planner import build_plan


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="dry-run the planner on a source and a target layout (JSON)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--source", required=True, help="layout JSON of what the trainer ranks hold")
    p.add_argument("--target", required=True, help="layout JSON of what the generator ranks need")
    p.add_argument(
        "--placement",
        help="JSON of where each source and target rank runs (device, node, gpu UUID)",
    )
    p.add_argument(
        "--same-host-transport",
        choices=SAME_HOST_CHOICES,
        default="auto",
        help="two GPUs of one node: ipc, nccl or auto (as REFIT_SAME_HOST_TRANSPORT)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--top",
        type=non_negative_int,
        default=20,
        help="links to list, busiest first (default 20)",
    )
    p.set_defaults(handler=run)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def load_placements(path: str, sources: int, targets: int) -> list[Placement]:
    """The group's placements (sources, then targets) from a `--placement` file."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot read --placement {path}: {exc.strerror or exc}", field="placement"
        ) from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"--placement {path}: not JSON ({exc})", field="placement") from None
    out: list[Placement] = []
    for side, count in (("source", sources), ("target", targets)):
        ranks = doc.get(side) if isinstance(doc, dict) else None
        if not isinstance(ranks, list) or len(ranks) != count:
            raise InvalidArgument(
                f"--placement {path}: '{side}' must list {count} rank(s), one object each",
                field=f"placement.{side}",
            )
        for rank, entry in enumerate(ranks):
            if not isinstance(entry, dict) or not all(
                isinstance(entry.get(k, ""), str) for k in ("device", "node", "gpu")
            ):
                raise InvalidArgument(
                    f"--placement {path}: {side} rank {rank} must be an object of strings "
                    "(device, node, gpu)",
                    field=f"placement.{side}[{rank}]",
                )
            out.append(
                Placement(entry.get("device", "cuda"), entry.get("node", ""), entry.get("gpu", ""))
            )
    return out


def add_transports(
    summary: dict[str, Any],
    placements: list[Placement],
    offset: int,
    same_host: SameHost,
) -> None:
    """Add the group's backend and each link's transport to a plan summary."""
    links = [(item["source_rank"], item["target_rank"] + offset) for item in summary["link_bytes"]]
    chosen = group_transports(placements, links, same_host)
    summary["backend"] = chosen.backend.value
    for item, link in zip(summary["link_bytes"], links, strict=True):
        item["transport"] = chosen.backend.value
        item["link_choice"] = chosen.links[link].value


def plan_summary(source: Layout, target: Layout) -> dict[str, Any]:
    offset = (max(source.ranks()) + 1) if source.ranks() else 0
    try:
        plan = build_plan(source, target.relabel({r: r + offset for r in target.ranks()}))
    except LayoutError as exc:
        # Errors about destinations name the rank as the target file numbers it.
        if exc.rank is not None and exc.rank >= offset:
            raise exc.with_rank(exc.rank - offset) from None
        raise
    stats: PlanStats = plan.stats()
    return {
        "plan_hash": plan.digest,
        "source_layout_hash": source.digest,
        "target_layout_hash": target.digest,
        "tensors": stats.num_tensors,
        "total_bytes": stats.total_bytes,
        "pieces": stats.num_pieces,
        "links": stats.num_links,
        "send_imbalance": round(stats.send_imbalance, 4),
        "recv_imbalance": round(stats.recv_imbalance, 4),
        "link_imbalance": round(stats.link_imbalance, 4),
        "send_bytes": {str(r): b for r, b in sorted(stats.send_bytes.items())},
        "recv_bytes": {str(r - offset): b for r, b in sorted(stats.recv_bytes.items())},
        "link_bytes": [
            {"source_rank": s, "target_rank": d - offset, "bytes": b}
            for (s, d), b in sorted(stats.link_bytes.items(), key=lambda kv: (-kv[1], kv[0]))
        ],
    }


def _print_table(summary: dict[str, Any], top: int) -> None:
    print(f"plan hash        {summary['plan_hash']}")
    print(f"tensors          {summary['tensors']}")
    print(f"total            {_human(summary['total_bytes'])} ({summary['total_bytes']} bytes)")
    print(f"pieces / links   {summary['pieces']} / {summary['links']}")
    print(
        "imbalance        "
        f"send {summary['send_imbalance']:.3f}  recv {summary['recv_imbalance']:.3f}  "
        f"link {summary['link_imbalance']:.3f}  (max/mean; 1.000 = perfect)"
    )
    print("\nsource rank   sends")
    for rank, b in summary["send_bytes"].items():
        print(f"  {rank:>9}   {_human(b)}")
    print("\ntarget rank   receives")
    for rank, b in summary["recv_bytes"].items():
        print(f"  {rank:>9}   {_human(b)}")
    links = summary["link_bytes"]
    print(f"\nlinks (busiest {min(top, len(links))} of {len(links)})")
    if "backend" in summary:
        print(f"  group backend {summary['backend']}")
        print("  source -> target   bytes        transport (alone)")
        for item in links[:top]:
            alone = item["link_choice"]
            note = f" ({alone})" if alone != item["transport"] else ""
            print(
                f"  {item['source_rank']:>6} -> {item['target_rank']:<6}   "
                f"{_human(item['bytes']):<12} {item['transport']}{note}"
            )
        return
    print("  source -> target   bytes")
    for item in links[:top]:
        print(f"  {item['source_rank']:>6} -> {item['target_rank']:<6}   {_human(item['bytes'])}")


def _load(path: str, flag: str) -> Layout:
    try:
        return load_layout(path)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot read --{flag} {path}: {exc.strerror or exc}", field=flag
        ) from None


def run(args: argparse.Namespace) -> int:
    source = _load(args.source, "source")
    target = _load(args.target, "target")
    summary = plan_summary(source, target)
    if args.placement:
        offset = (max(source.ranks()) + 1) if source.ranks() else 0
        targets = (max(target.ranks()) + 1) if target.ranks() else 0
        placements = load_placements(args.placement, offset, targets)
        add_transports(summary, placements, offset, args.same_host_transport)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
    else:
        _print_table(summary, args.top)
    return 0
