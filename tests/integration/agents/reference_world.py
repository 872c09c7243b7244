"""Trainer agents and reference generator engines of one job, as threads of a test (each
with its own gRPC session and Gloo process group), against a real coordinator."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from refitplane.client import RefitClient
from refitplane.generator.hf_tensor_parallel import tp_boxes
from refitplane.generator.reference_engine import ReferenceEngine, shard_state, specs_of
from refitplane.reshard.boxes import to_slices
from refitplane.trainer.agent import TrainerAgent


def reference_generators(
    coordinator: Any,
    job: str,
    specs: Mapping[str, Any],
    *,
    tp: int,
    replicas: int,
    initial: Mapping[str, torch.Tensor],
) -> list[ReferenceEngine]:
    """`replicas` generator replicas (`rep-0`, ...) of `tp` ranks each, holding `initial`."""
    return [
        ReferenceEngine(
            coordinator=coordinator.grpc_target,
            job=job,
            replica_id=f"rep-{i}",
            rank=r,
            world_size=tp,
            specs=specs,
            initial=initial,
        )
        for i in range(replicas)
        for r in range(tp)
    ]


def trainer_ranks(
    coordinator: Any,
    job: str,
    truth: Mapping[str, torch.Tensor],
    *,
    tp: int,
    pp: int = 1,
    stage_of: Callable[[str], int] = lambda name: 0,
    ranks: Iterable[int] | None = None,
) -> list[TrainerAgent]:
    """PP x TP trainer ranks (rank = stage * tp + tp_rank; all, or `ranks`), each holding
    its stage's tensors (`stage_of`) split by TP, filled from `truth`."""
    specs = specs_of(truth)
    agents = []
    for r in range(pp * tp) if ranks is None else ranks:
        stage, tp_rank = divmod(r, tp)
        held = {n: spec for n, spec in specs.items() if stage_of(n) == stage}
        agents.append(
            TrainerAgent(
                coordinator=coordinator.grpc_target,
                job=job,
                rank=r,
                world_size=pp * tp,
                shards=shard_state(held, tp_rank, tp, torch.device("cpu"), truth),
            )
        )
    return agents


@contextlib.contextmanager
def running(agents: list[Any]) -> Iterator[None]:
    """Start every agent; close them all (the list as it is then) on the way out."""
    try:
        for agent in agents:
            agent.start()
        yield
    finally:
        for agent in agents:
            agent.close()


def wait_layouts(client: RefitClient, job: str, members: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(1 for m in client.topology(job).members if m.layout_digest) >= members:
            return
        time.sleep(0.05)
    raise AssertionError(f"members did not publish layouts: {client.topology(job)}")


def held_boxes(gen: ReferenceEngine, names: Iterable[str]) -> Iterator[tuple[str, Any, Any]]:
    """(name, the bytes `gen` holds of it, its box) for each of `names` it holds a part of."""
    for name in names:
        box = tp_boxes(gen.specs[name], gen.world_size).get(gen.rank)
        if box is not None:
            yield name, gen.shards.view(name, box).view(torch.uint8), box


def assert_holds(
    gens: list[ReferenceEngine], truth: Mapping[str, torch.Tensor], version: int
) -> None:
    """Every generator rank is at `version` and holds exactly its boxes of `truth`."""
    for g in gens:
        assert g.version == version, (g.session.info.replica_id, g.rank, g.version)
        for name, held, box in held_boxes(g, truth):
            expected = truth[name][to_slices(box)].view(torch.uint8)
            assert torch.equal(held, expected), (g.session.info.replica_id, g.rank, name)
