"""Delta refits through a real coordinator (Gloo, CPU): only changed words on the wire,
resharded, every byte verified, and the full path wherever the base is not certain.

The agents of all ranks run as threads of this test (each with its own gRPC session and
Gloo process group); the trainer changes a sparse random set of elements between refits
under `updating_weights()`, as an optimizer step would."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from refitplane.client import RefitClient
from refitplane.generator.reference_engine import ReferenceEngine, specs_of
from refitplane.protocol import Refit, RefitState
from refitplane.reshard.boxes import to_slices
from refitplane.trainer.agent import TrainerAgent
from tests.integration.agents.reference_world import (
    assert_holds,
    reference_generators,
    running,
    trainer_ranks,
    wait_layouts,
)

pytestmark = pytest.mark.integration

JOB = "job-delta"


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return {
        "model.embed_tokens.weight": bf16(96, 64),
        "model.layers.0.self_attn.q_proj.weight": bf16(64, 64),
        "model.layers.0.self_attn.o_proj.weight": bf16(64, 64),
        "model.layers.0.mlp.down_proj.weight": bf16(64, 160),
        "model.layers.1.mlp.up_proj.weight": bf16(160, 64),
        "model.norm.weight": torch.randn(64, generator=g),
        "model.layers.1.mlp.gate_proj.weight": torch.randint(
            -100, 100, (160, 64), generator=g, dtype=torch.int8
        ).view(torch.float8_e4m3fn),
    }


def _perturb(state: dict[str, torch.Tensor], fraction: float, seed: int) -> None:
    """Change about `fraction` of every tensor's elements in place (bit flips of the low
    byte, so every dtype changes and no value is left as it was by chance)."""
    g = torch.Generator().manual_seed(seed)
    for tensor in state.values():
        flat = tensor.view(-1).view(torch.uint8).view(tensor.numel(), tensor.element_size())
        picked = torch.rand(tensor.numel(), generator=g) < fraction
        flat[picked, 0] ^= 0x01


def _stage(name: str, pp: int) -> int:
    """Pipeline stage of a tensor: decoder layer i on stage i % pp, the embedding first,
    the final norm last."""
    if ".layers." in name:
        return int(name.split(".layers.")[1].split(".")[0]) % pp
    return 0 if "embed" in name else pp - 1


@contextlib.contextmanager
def _session(
    coordinator_factory: Callable[..., Any],
    delta: str,
    *,
    trainer_tp: int,
    gen_tp: int,
    replicas: int = 1,
    pp: int = 1,
) -> Iterator[
    tuple[Any, list[TrainerAgent], list[ReferenceEngine], dict[str, torch.Tensor], RefitClient]
]:
    """A coordinator with REFIT_DELTA=`delta`, PP x TP trainer ranks holding `truth`,
    generator replicas at `gen_tp` holding another checkpoint, all layouts published."""
    # Leases are not what these tests exercise: 3 s (the test default) expired every member at
    # once when a loaded 2-core CI box starved this process's renewals (2026-11-26).
    coordinator = coordinator_factory(
        transfer_timeout_s=30.0,
        prepare_timeout_s=30.0,
        group_timeout_s=30.0,
        lease_ttl_s=15.0,
        delta=delta,
    )
    truth = _state(1)
    trainers = trainer_ranks(
        coordinator, JOB, truth, tp=trainer_tp, pp=pp, stage_of=lambda n: _stage(n, pp)
    )
    gens = reference_generators(
        coordinator, JOB, specs_of(truth), tp=gen_tp, replicas=replicas, initial=_state(0)
    )
    with running([*trainers, *gens]), RefitClient(coordinator.grpc_target) as client:
        wait_layouts(client, JOB, len(trainers) + len(gens))
        yield coordinator, trainers, gens, truth, client


def _step(
    trainers: list[TrainerAgent], truth: dict[str, torch.Tensor], fraction: float, seed: int
) -> None:
    """An optimizer step on every trainer rank: the trainers' shards are views of their own
    copies of `truth`, so the same change is made to each and to `truth`."""
    _perturb(truth, fraction, seed)
    for t in trainers:
        with t.updating_weights():
            for sv in t.member._shards():
                sv.tensor.copy_(truth[sv.spec.name][to_slices(sv.box)])


def _refit(client: RefitClient, key: str, replicas: list[str] | None = None) -> Refit:
    done = client.wait(
        client.trigger(JOB, idempotency_key=key, target_replicas=replicas or ()).refit_id,
        timeout_s=60,
    )
    assert done.state == RefitState.COMMITTED, (done.reason, done.message)
    assert done.tensors_verified == done.tensors_total > 0
    return done


@pytest.mark.parametrize(
    ("pp", "trainer_tp", "gen_tp", "replicas"),
    [(1, 2, 3, 1), (1, 2, 1, 1), (1, 3, 2, 2), (2, 2, 4, 1)],
    ids=["tp2-tp3", "tp2-tp1", "tp3-2xtp2", "pp2tp2-tp4"],
)
def test_delta_refits_move_only_changes_and_end_exact(
    coordinator_factory: Callable[..., Any], pp: int, trainer_tp: int, gen_tp: int, replicas: int
) -> None:
    names = [f"rep-{i}" for i in range(replicas)]
    with _session(
        coordinator_factory, "on", trainer_tp=trainer_tp, gen_tp=gen_tp, replicas=replicas, pp=pp
    ) as (coordinator, trainers, gens, truth, client):
        first = _refit(client, "k0")
        assert first.delta_replicas == []  # no base yet: the full path
        assert first.bytes_on_wire == first.bytes_total
        assert_holds(gens, truth, first.version)
        for i, fraction in enumerate((0.001, 0.01, 0.05, 0.2, 0.9)):
            _step(trainers, truth, fraction, seed=100 + i)
            done = _refit(client, f"k{i + 1}")
            assert sorted(done.delta_replicas) == names
            assert_holds(gens, truth, done.version)
            assert done.bytes_on_wire < done.bytes_total, (fraction, done.bytes_on_wire)
            if fraction <= 0.01:
                assert done.bytes_on_wire < done.bytes_total / 5, fraction
            # One replica fed from whole shards: the scan advanced each base in place (no
            # snapshot copy); two replicas read the same base twice, so it is copied after.
            advanced = {t.member.last_report.delta_base_advanced for t in trainers}
            if replicas > 1:
                assert advanced == {False}
            elif gen_tp == 1:
                assert advanced == {True}
        metrics = coordinator.core.metrics.registry
        assert (
            metrics.get_sample_value("refit_replica_updates_total", {"path": "DELTA"})
            == 5 * replicas
        )
        assert metrics.get_sample_value("refit_replica_updates_total", {"path": "FULL"}) == replicas
        assert metrics.get_sample_value("refit_wire_bytes_total") < metrics.get_sample_value(
            "refit_bytes_total"
        )


def test_a_replica_that_missed_a_version_gets_the_full_path(
    coordinator_factory: Callable[..., Any],
) -> None:
    with _session(coordinator_factory, "auto", trainer_tp=2, gen_tp=2, replicas=2) as (
        _,
        trainers,
        gens,
        truth,
        client,
    ):
        _refit(client, "k0")
        _step(trainers, truth, 0.01, seed=1)
        only_first = _refit(client, "k1", ["rep-0"])
        assert only_first.delta_replicas == ["rep-0"]
        _step(trainers, truth, 0.01, seed=2)
        both = _refit(client, "k2")
        # rep-1 holds version 1, the trainers' base is version 2: rep-1 goes in full.
        assert both.delta_replicas == ["rep-0"]
        assert_holds(gens, truth, both.version)
        _step(trainers, truth, 0.01, seed=3)
        again = _refit(client, "k3")
        assert again.delta_replicas == ["rep-0", "rep-1"]
        assert_holds(gens, truth, again.version)


@pytest.mark.parametrize(
    ("delta", "link_gbps"), [("off", ""), ("auto", "1000000")], ids=["off", "auto-fast-link"]
)
def test_delta_off_sends_in_full_and_keeps_no_snapshot(
    coordinator_factory: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    delta: str,
    link_gbps: str,
) -> None:
    """REFIT_DELTA=off, or "auto" on a link faster than any delta (REFIT_DELTA_LINK_GBPS
    high, `delta_cost.never_pays`): the trainers keep no delta base, so they report none and
    the coordinator asks for no delta: every refit is a plain full one."""
    monkeypatch.setenv("REFIT_DELTA_LINK_GBPS", link_gbps)
    with _session(coordinator_factory, delta, trainer_tp=2, gen_tp=1) as (
        _,
        trainers,
        gens,
        truth,
        client,
    ):
        for i in range(3):
            _step(trainers, truth, 0.01, seed=i)
            done = _refit(client, f"k{i}")
            assert done.delta_replicas == []
            assert done.bytes_on_wire == done.bytes_total
            assert all(t.member.delta_snapshot.nbytes == 0 for t in trainers)
        assert_holds(gens, truth, done.version)


def test_a_restarted_trainer_rank_sends_in_full_once(
    coordinator_factory: Callable[..., Any],
) -> None:
    """A trainer rank that comes back (new process, new member id) holds no base: the next
    refit goes in full, the one after is a delta again."""
    with _session(coordinator_factory, "on", trainer_tp=2, gen_tp=2) as (
        coordinator,
        trainers,
        gens,
        truth,
        client,
    ):
        _refit(client, "k0")
        _step(trainers, truth, 0.01, seed=1)
        assert _refit(client, "k1").delta_replicas == ["rep-0"]
        trainers[1].close()
        (trainers[1],) = trainer_ranks(coordinator, JOB, truth, tp=2, ranks=[1])
        with running([trainers[1]]):
            wait_layouts(client, JOB, 4)
            _step(trainers, truth, 0.01, seed=2)
            restarted = _refit(client, "k2")
            assert restarted.delta_replicas == []
            assert restarted.bytes_on_wire == restarted.bytes_total
            assert_holds(gens, truth, restarted.version)
            _step(trainers, truth, 0.01, seed=3)
            again = _refit(client, "k3")
            assert again.delta_replicas == ["rep-0"]
            assert_holds(gens, truth, again.version)


def test_a_sender_that_lost_its_base_sends_in_full(
    coordinator_factory: Callable[..., Any],
) -> None:
    """A trainer rank whose base is gone without the coordinator knowing (a transfer that
    failed after its scan advanced the base part-way, say) is still named for deltas: it
    sends every message dense, the refit commits exact, and the next one is a delta again."""
    with _session(coordinator_factory, "on", trainer_tp=2, gen_tp=1) as (
        _,
        trainers,
        gens,
        truth,
        client,
    ):
        _refit(client, "k0")
        _step(trainers, truth, 0.01, seed=1)
        assert _refit(client, "k1").delta_replicas == ["rep-0"]
        trainers[0].member.delta_snapshot.invalidate()
        _step(trainers, truth, 0.01, seed=2)
        lost = _refit(client, "k2")
        assert lost.delta_replicas == ["rep-0"]
        report = trainers[0].member.last_report
        assert report is not None
        assert report.delta_messages == 0
        assert report.bytes_sent == report.bytes_full
        assert_holds(gens, truth, lost.version)
        _step(trainers, truth, 0.01, seed=3)
        again = _refit(client, "k3")
        assert again.bytes_on_wire < again.bytes_total / 5
        assert_holds(gens, truth, again.version)
