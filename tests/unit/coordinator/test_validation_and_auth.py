"""Input checks, the token check and the error table: each names the field at fault."""

from __future__ import annotations

import grpc
import pytest

from refitplane import errors
from refitplane.coordinator.auth import TokenCheck
from refitplane.coordinator.core.ratelimit import TriggerRateLimiter
from refitplane.coordinator.core.validation import (
    check_idempotency_key,
    check_member,
    check_name,
    check_targets,
)
from refitplane.coordinator.error_codes import grpc_status, http_status
from refitplane.protocol import Role
from refitplane.protocol.messages import MemberInfo

pytestmark = pytest.mark.unit


def _info(**kw):
    base = {"job": "j", "role": Role.TRAINER, "rank": 0, "world_size": 1, "device": "cpu"}
    return MemberInfo(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"job": "-x"}, "job"),
        ({"job": "x" * 129}, "job"),
        ({"replica_id": "r"}, "replica_id"),
        ({"role": Role.GENERATOR, "replica_id": ""}, "replica_id"),
        ({"world_size": 0}, "world_size"),
        ({"rank": 1}, "rank"),
        ({"role": Role.GENERATOR_SIDECAR, "replica_id": "r", "rank": 1, "world_size": 2}, "rank"),
        ({"device": "cuda:x"}, "device"),
        ({"host": "h" * 256}, "host"),
        ({"labels": {f"k{i}": "v" for i in range(65)}}, "labels"),
        ({"labels": {"ok": "v" * 257}}, "labels"),
        ({"version": -1}, "version"),
    ],
)
def test_member_checks_name_the_field(kw, field):
    with pytest.raises(errors.InvalidArgument) as err:
        check_member(_info(**kw))
    assert err.value.field == field


def test_valid_members():
    check_member(_info(device="cuda:3", labels={"app.kubernetes.io/name": "trainer"}))
    check_member(_info(role=Role.GENERATOR_SIDECAR, replica_id="r-0", device="", world_size=4))


def test_names_keys_targets():
    assert check_name("job-1.a_b", "job") == "job-1.a_b"
    hostile = "x" * 10_000
    with pytest.raises(errors.InvalidArgument) as err:
        check_name(hostile, "job")
    assert len(err.value.message) < 300  # hostile input is cut, not echoed
    with pytest.raises(errors.InvalidArgument):
        check_idempotency_key("a\nb")
    assert check_targets(["b", "a", "b"]) == ["a", "b"]
    with pytest.raises(errors.InvalidArgument) as err:
        check_targets(["ok", "not ok"])
    assert err.value.field == "target_replicas[1]"


def test_token_check():
    TokenCheck(None).check(None)
    check = TokenCheck("abc")
    check.check("Bearer abc")
    check.check("bearer abc")
    for bad in (None, "", "abc", "Bearer abd", "Basic abc", "Bearer abcd"):
        with pytest.raises(errors.Unauthenticated) as err:
            check.check(bad)
        assert "abc" not in err.value.message


def test_rate_limiter():
    limiter = TriggerRateLimiter(0)
    for _ in range(100):
        limiter.check("j")
    limiter = TriggerRateLimiter(2)
    limiter.check("j")
    limiter.check("j")
    with pytest.raises(errors.RateLimited):
        limiter.check("j")
    limiter.check("other-job")


@pytest.mark.parametrize(
    ("exc", "code", "status"),
    [
        (errors.InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT, 400),
        (errors.CoverageError("x"), grpc.StatusCode.INVALID_ARGUMENT, 400),
        (errors.NotFound("x"), grpc.StatusCode.NOT_FOUND, 404),
        (errors.Conflict("x"), grpc.StatusCode.ABORTED, 409),
        (errors.FailedPrecondition("x"), grpc.StatusCode.FAILED_PRECONDITION, 409),
        (errors.Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED, 401),
        (errors.RateLimited("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (errors.Unavailable("x"), grpc.StatusCode.UNAVAILABLE, 503),
        (errors.TransferTimeout("x"), grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (errors.TransferError("x"), grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_error_table(exc, code, status):
    assert grpc_status(exc) == code
    assert http_status(exc) == status
