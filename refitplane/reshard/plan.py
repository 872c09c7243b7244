"""Plans: for each (source rank, destination rank) link, the ordered pieces to move.

A plan depends only on the two layouts (and the planner version), so its digest is the
hash of those inputs; it is computed once and reused every step. Ranks in a plan are the
group ranks both sides share (the coordinator relabels before planning).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import Box, box_numel
from refitplane.reshard.layout import TensorSpec

PLANNER_VERSION = "1"


@dataclass(frozen=True, slots=True)
class Piece:
    """One box of one tensor, in the tensor's global coordinates."""

    tensor: str
    box: Box


@dataclass(frozen=True, slots=True)
class Link:
    src: int
    dst: int
    pieces: tuple[Piece, ...]
    nbytes: int


@dataclass(frozen=True)
class PlanStats:
    total_bytes: int
    num_pieces: int
    num_links: int
    num_tensors: int
    send_bytes: Mapping[int, int]
    recv_bytes: Mapping[int, int]
    link_bytes: Mapping[tuple[int, int], int]
    send_imbalance: float
    recv_imbalance: float
    link_imbalance: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes,
            "num_pieces": self.num_pieces,
            "num_links": self.num_links,
            "num_tensors": self.num_tensors,
            "send_bytes": {str(k): v for k, v in sorted(self.send_bytes.items())},
            "recv_bytes": {str(k): v for k, v in sorted(self.recv_bytes.items())},
            "link_bytes": {f"{s}->{d}": v for (s, d), v in sorted(self.link_bytes.items())},
            "send_imbalance": self.send_imbalance,
            "recv_imbalance": self.recv_imbalance,
            "link_imbalance": self.link_imbalance,
        }


def _imbalance(values: Iterable[int]) -> float:
    """max / mean; 1.0 is perfect balance (and the value for no traffic)."""
    items = list(values)
    if not items or sum(items) == 0:
        return 1.0
    return max(items) / (sum(items) / len(items))


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a plan: what it sends and what it receives, with the specs."""

    rank: int
    specs: Mapping[str, TensorSpec]
    sends: tuple[Link, ...]
    recvs: tuple[Link, ...]
    plan_digest: str

    @property
    def send_bytes(self) -> int:
        return sum(link.nbytes for link in self.sends)

    @property
    def recv_bytes(self) -> int:
        return sum(link.nbytes for link in self.recvs)

    @cached_property
    def tensors_received(self) -> int:
        """Distinct tensors this rank receives pieces of (what a receiver's executor counts
        as `tensors_total`), counted once per rank plan: thousands of pieces on an MoE
        shape, which the coordinator checked at every TransferDone (1.3-1.8 ms of the
        Qwen3-30B-A3B shape's TRANSFERRING, after its last report)."""
        return len({piece.tensor for link in self.recvs for piece in link.pieces})


@dataclass(frozen=True)
class Plan:
    specs: Mapping[str, TensorSpec]
    links: tuple[Link, ...]
    digest: str
    source_ranks: tuple[int, ...]
    target_ranks: tuple[int, ...]
    _by_rank: dict[int, tuple[list[Link], list[Link]]] = field(
        default_factory=dict, repr=False, compare=False
    )
    # Rank plans made so far: a plan the coordinator keeps serves every refit that reuses
    # it with the same objects (and what they computed once, e.g. `tensors_received`).
    _rank_plans: dict[int, RankPlan] = field(default_factory=dict, repr=False, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(link.nbytes for link in self.links)

    def rank_plan(self, rank: int) -> RankPlan:
        made = self._rank_plans.get(rank)
        if made is None:
            made = self._rank_plans[rank] = self._make_rank_plan(rank)
        return made

    def _make_rank_plan(self, rank: int) -> RankPlan:
        if not self._by_rank:
            for link in self.links:
                self._by_rank.setdefault(link.src, ([], []))[0].append(link)
                self._by_rank.setdefault(link.dst, ([], []))[1].append(link)
        sends, recvs = self._by_rank.get(rank, ([], []))
        names = {p.tensor for link in (*sends, *recvs) for p in link.pieces}
        return RankPlan(
            rank=rank,
            specs={n: self.specs[n] for n in sorted(names)},
            sends=tuple(sends),
            recvs=tuple(recvs),
            plan_digest=self.digest,
        )

    def stats(self) -> PlanStats:
        send: dict[int, int] = dict.fromkeys(self.source_ranks, 0)
        recv: dict[int, int] = dict.fromkeys(self.target_ranks, 0)
        links: dict[tuple[int, int], int] = {}
        pieces = 0
        for link in self.links:
            send[link.src] = send.get(link.src, 0) + link.nbytes
            recv[link.dst] = recv.get(link.dst, 0) + link.nbytes
            links[(link.src, link.dst)] = link.nbytes
            pieces += len(link.pieces)
        return PlanStats(
            total_bytes=sum(links.values()),
            num_pieces=pieces,
            num_links=len(links),
            num_tensors=len(self.specs),
            send_bytes=send,
            recv_bytes=recv,
            link_bytes=links,
            send_imbalance=_imbalance(send.values()),
            recv_imbalance=_imbalance(recv.values()),
            link_imbalance=_imbalance(links.values()),
        )


def plan_digest(source_digest: str, target_digest: str, extra: str = "") -> str:
    h = hashlib.sha256(
        f"planner-v{PLANNER_VERSION}|{source_digest}|{target_digest}|{extra}".encode()
    )
    return h.hexdigest()


def link_bytes(pieces: Iterable[Piece], specs: Mapping[str, TensorSpec]) -> int:
    return sum(box_numel(p.box) * specs[p.tensor].itemsize for p in pieces)


# --- serialisation -------------------------------------------------------------------------
# Compact JSON: tensors are referred to by index into `specs`, boxes as flat int lists.


def _flat(box: Box) -> list[int]:
    return [v for pair in box for v in pair]


def _unflat(values: list[int]) -> Box:
    if len(values) % 2:
        raise LayoutError(f"a box needs start/stop pairs, got {len(values)} values", field="box")
    return tuple((values[i], values[i + 1]) for i in range(0, len(values), 2))


def _specs_to_list(specs: Mapping[str, TensorSpec]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    names = sorted(specs)
    return (
        [{"name": n, "shape": list(specs[n].shape), "dtype": specs[n].dtype} for n in names],
        {n: i for i, n in enumerate(names)},
    )


def _links_to_list(links: Iterable[Link], index: Mapping[str, int]) -> list[dict[str, Any]]:
    return [
        {
            "src": link.src,
            "dst": link.dst,
            "nbytes": link.nbytes,
            "pieces": [[index[p.tensor], *_flat(p.box)] for p in link.pieces],
        }
        for link in links
    ]


def _links_from_list(raw: list[dict[str, Any]], names: list[str]) -> tuple[Link, ...]:
    return tuple(
        Link(
            src=int(item["src"]),
            dst=int(item["dst"]),
            nbytes=int(item["nbytes"]),
            pieces=tuple(Piece(names[p[0]], _unflat(p[1:])) for p in item["pieces"]),
        )
        for item in raw
    )


def _specs_from_list(raw: list[dict[str, Any]]) -> dict[str, TensorSpec]:
    specs = [TensorSpec.create(s["name"], s["shape"], s["dtype"]) for s in raw]
    return {s.name: s for s in specs}


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    spec_list, index = _specs_to_list(plan.specs)
    return {
        "digest": plan.digest,
        "specs": spec_list,
        "source_ranks": list(plan.source_ranks),
        "target_ranks": list(plan.target_ranks),
        "links": _links_to_list(plan.links, index),
    }


def plan_from_dict(doc: Mapping[str, Any]) -> Plan:
    specs = _specs_from_list(doc["specs"])
    names = [s["name"] for s in doc["specs"]]
    return Plan(
        specs=specs,
        links=_links_from_list(doc["links"], names),
        digest=str(doc["digest"]),
        source_ranks=tuple(doc["source_ranks"]),
        target_ranks=tuple(doc["target_ranks"]),
    )


def rank_plan_to_dict(rp: RankPlan) -> dict[str, Any]:
    spec_list, index = _specs_to_list(rp.specs)
    return {
        "rank": rp.rank,
        "digest": rp.plan_digest,
        "specs": spec_list,
        "sends": _links_to_list(rp.sends, index),
        "recvs": _links_to_list(rp.recvs, index),
    }


def rank_plan_from_dict(doc: Mapping[str, Any]) -> RankPlan:
    names = [s["name"] for s in doc["specs"]]
    return RankPlan(
        rank=int(doc["rank"]),
        specs=_specs_from_list(doc["specs"]),
        sends=_links_from_list(doc["sends"], names),
        recvs=_links_from_list(doc["recvs"], names),
        plan_digest=str(doc["digest"]),
    )
