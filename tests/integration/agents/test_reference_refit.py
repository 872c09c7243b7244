"""Trainer agents → reference generator engines through a real coordinator (Gloo, CPU).

Everything real but the processes: the agents of all ranks run as threads of this test
(each with its own gRPC session and its own Gloo process group)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from refitplane.client import RefitClient
from refitplane.generator.reference_engine import ReferenceEngine, specs_of
from refitplane.protocol import RefitState
from refitplane.testing.hops import hop_line, stamped_ranks
from refitplane.trainer.agent import TrainerAgent
from tests.integration.agents.reference_world import (
    assert_holds,
    held_boxes,
    reference_generators,
    running,
    trainer_ranks,
    wait_layouts,
)

pytestmark = pytest.mark.integration


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(96, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).to(
            torch.bfloat16
        ),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(32, 32, generator=g).to(
            torch.bfloat16
        ),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 80, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(80, 32, generator=g).to(
            torch.bfloat16
        ),
        "model.layers.0.mlp.experts.1.up_proj.weight": torch.randn(80, 32, generator=g).to(
            torch.bfloat16
        ),
        "model.norm.weight": torch.randn(32, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randint(
            -100, 100, (80, 32), generator=g, dtype=torch.int8
        ).view(torch.float8_e4m3fn),
        "model.layers.0.mlp.gate_proj.weight_scale_inv": torch.rand(1, 1, generator=g),
    }


@contextlib.contextmanager
def _world(
    coordinator: Any, trainer_tp: int, gen_tp: int, replicas: int = 1
) -> Iterator[tuple[list[TrainerAgent], list[ReferenceEngine], dict[str, torch.Tensor]]]:
    v0, v1 = _state(0), _state(1)
    trainers = trainer_ranks(coordinator, "job-a", v1, tp=trainer_tp)
    gens = reference_generators(
        coordinator, "job-a", specs_of(v1), tp=gen_tp, replicas=replicas, initial=v0
    )
    with running([*trainers, *gens]):
        yield trainers, gens, v1


@pytest.mark.parametrize(("trainer_tp", "gen_tp", "replicas"), [(2, 1, 1), (2, 3, 1), (3, 2, 2)])
def test_refit_commits_and_bytes_match(
    coordinator_factory: Callable[..., Any], trainer_tp: int, gen_tp: int, replicas: int
) -> None:
    coordinator = coordinator_factory(
        transfer_timeout_s=30.0, prepare_timeout_s=30.0, group_timeout_s=30.0
    )
    with (
        _world(coordinator, trainer_tp, gen_tp, replicas) as (trainers, gens, truth),
        RefitClient(coordinator.grpc_target) as client,
    ):
        wait_layouts(client, "job-a", trainer_tp + gen_tp * replicas)
        refit = client.trigger("job-a", idempotency_key="k1")
        final = client.wait(refit.refit_id, timeout_s=60)
        assert final.state == RefitState.COMMITTED, final
        assert final.tensors_verified == final.tensors_total > 0
        # Every rank's bytes add up to its plan's total: its TransferDone says so (ranks send
        # no Progress at the end of a transfer, and none during one this short).
        assert final.ranks
        assert all(r.bytes_total == r.bytes_sent + r.bytes_received > 0 for r in final.ranks), (
            final.ranks
        )
        # The record keeps every data-plane rank's hop timeline (issue 23), in order, inside
        # the coordinator's StartTransfer -> end of TRANSFERRING (one host's wall clock).
        assert len(stamped_ranks(final)) == trainer_tp + gen_tp * replicas, final.ranks
        assert 0 < final.start_sent_ns <= final.transfer_end_ns
        for r in final.ranks:
            stamps = [r.start_seen_ns, r.executor_start_ns, r.executor_end_ns, r.done_sent_ns]
            assert final.start_sent_ns <= stamps[0], r
            assert stamps == sorted(stamps), r
            assert stamps[-1] <= r.done_recorded_ns <= final.transfer_end_ns, r
        assert hop_line(final).count("/") == 5 * (len(final.ranks) - 1), hop_line(final)
        assert_holds(gens, truth, final.version)
        topo = client.topology("job-a")
        assert {r.version for r in topo.replicas} == {final.version}
        # A second refit reuses the group and the cached plan.
        again = client.wait(client.trigger("job-a", idempotency_key="k2").refit_id, timeout_s=60)
        assert again.state == RefitState.COMMITTED
        assert again.version == final.version + 1
        # Every rank armed its run after reporting Prepared and its StartTransfer ran that
        # run (docs/coordinator.md, "Armed runs").
        for agent in [*trainers, *gens]:
            report = agent.member.last_report
            assert report is not None
            assert report.armed_seconds > 0, report


def test_named_plans_and_a_lost_plan_cache_over_gloo(
    coordinator_factory: Callable[..., Any],
) -> None:
    """Refits after the first name the plan; ranks whose plan cache was emptied (evicted, or
    lost under the same member id) answer PlanMissing, get the body again, and the refit
    still moves and verifies every byte."""
    coordinator = coordinator_factory(
        transfer_timeout_s=30.0, prepare_timeout_s=30.0, group_timeout_s=30.0
    )
    with (
        _world(coordinator, 2, 2) as (trainers, gens, truth),
        RefitClient(coordinator.grpc_target) as client,
    ):
        wait_layouts(client, "job-a", 4)
        for key in ("k1", "k2"):
            done = client.wait(client.trigger("job-a", idempotency_key=key).refit_id, timeout_s=60)
            assert done.state == RefitState.COMMITTED, done
        for agent in (*trainers, *gens):
            assert (agent.member.plans.bodies, agent.member.plans.hits) == (1, 1)

        trainers[0].member.plans.clear()
        gens[1].member.plans.clear()
        for g in gens:  # so that only this refit's bytes can make them right again
            for _, held, _ in held_boxes(g, truth):
                held.zero_()
        final = client.wait(client.trigger("job-a", idempotency_key="k3").refit_id, timeout_s=60)
        assert final.state == RefitState.COMMITTED, final
        assert final.tensors_verified == final.tensors_total > 0
        metrics = coordinator.core.metrics.registry
        assert metrics.get_sample_value("refit_rank_plans_total", {"how": "RESENT"}) == 2
        assert trainers[0].member.plans.misses == 1
        assert gens[1].member.plans.misses == 1
        assert_holds(gens, truth, final.version)
