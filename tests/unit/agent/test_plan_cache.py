"""The rank's plan cache: bodies are kept, names resolve to the same object, the least
recently used plan goes first, and what a plan implies is computed once."""

from __future__ import annotations

import pytest

from refitplane.agent.plan_cache import RankPlanCache
from refitplane.errors import InvalidArgument
from refitplane.protocol.messages import PrepareRefitCmd
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.plan import Link, Piece, RankPlan

SPEC = TensorSpec.create("w", [4, 4], "float32")


def _plan(digest: str, rank: int = 1) -> RankPlan:
    pieces = (Piece("w", ((0, 2), (0, 4))), Piece("w", ((2, 4), (0, 4))))
    return RankPlan(
        rank=rank,
        specs={"w": SPEC},
        sends=(),
        recvs=(Link(src=0, dst=rank, pieces=pieces, nbytes=64),),
        plan_digest=digest,
    )


def _cmd(plan: RankPlan | None, digest: str, rank: int = 1) -> PrepareRefitCmd:
    return PrepareRefitCmd(
        refit_id="r", version=1, epoch=1, plan=plan, plan_digest=digest, plan_rank=rank
    )


def test_a_body_is_kept_and_a_name_resolves_to_it():
    cache = RankPlanCache()
    plan = _plan("a")
    held = cache.resolve(_cmd(plan, "a"))
    assert held is not None
    assert (held.recv_bytes, held.send_bytes, held.tensors_received) == (64, 0, 1)
    again = cache.resolve(_cmd(None, "a"))
    assert again is held
    assert again.plan is plan
    assert (cache.bodies, cache.hits, cache.misses) == (1, 1, 0)
    # Another rank's part of the same plan is another plan.
    assert cache.resolve(_cmd(None, "a", rank=2)) is None
    assert cache.misses == 1


def test_the_same_body_again_keeps_the_object_already_held():
    cache = RankPlanCache()
    first = cache.resolve(_cmd(_plan("a"), "a"))
    second = cache.resolve(_cmd(_plan("a"), "a"))
    assert second is first


def test_least_recently_used_plan_is_evicted():
    cache = RankPlanCache(capacity=2)
    cache.resolve(_cmd(_plan("a"), "a"))
    cache.resolve(_cmd(_plan("b"), "b"))
    assert cache.resolve(_cmd(None, "a")) is not None  # a is now the most recent
    cache.resolve(_cmd(_plan("c"), "c"))
    assert cache.keys() == [("a", 1), ("c", 1)]
    assert cache.resolve(_cmd(None, "b")) is None
    assert "plan b rank 1 is not in this rank's plan cache (2 of at most 2" in (
        cache.missing_message(_cmd(None, "b"))
    )


def test_a_body_that_is_not_the_named_plan_is_refused():
    with pytest.raises(InvalidArgument) as err:
        RankPlanCache().resolve(_cmd(_plan("a"), "b"))
    assert err.value.field == "plan_digest"


def test_capacity_must_be_positive():
    with pytest.raises(InvalidArgument):
        RankPlanCache(capacity=0)
