"""The flows of vLLM's weight-transfer verbs for the refitplane backend, as pure logic.

vLLM turns each verb (`/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights`, `/finish_weight_update`, `/update_weight_version`,
`/shutdown_weight_transfer_engine`, and the same methods of `LLM` / `AsyncLLM`) into one
`collective_rpc` to every worker. Two things make that unsafe to use naively:

- a worker that raises desynchronises vLLM's RPC replies at TP > 1 (the executor reads one
  reply per worker in rank order and stops at the first error; the rest are read by the
  next call), so the refitplane engine never raises; and
- `finish_weight_update(weight_version)` sets the version in the API process whatever the
  workers did.

So the promises are kept in the API process (`vllm_api_guard` runs these flows there): the
payloads are validated before any RPC (bad input is a 400 naming the field), every worker's
outcome is read back with a status RPC into the engine (`ENGINE_ATTR`, which never
raises), protocol misuse that would make vLLM's own worker code raise is refused before the
RPC (409), and a version is set only when every worker verified and applied what it
received. Each flow is a generator of the steps it needs (`Rpc`, `GetVersion`,
`SetVersion`, `ClearPrefixCache`), so the same logic drives the async server and the offline
`LLM`. The payloads and statuses they read are `vllm_contract`'s.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from refitplane.errors import FailedPrecondition, InvalidArgument, RefitError, TransferError
from refitplane.generator.vllm_contract import (
    ENGINE_ATTR,
    INCOMPLETE_VERSION,
    EngineStatus,
    Problem,
    UpdateRecord,
    parse_init_info,
    parse_update_info,
    read_statuses,
)
from refitplane.protocol import Reason


def _who(statuses: Sequence[EngineStatus]) -> str:
    shown = [f"{s['replica'] or 'replica ?'} rank {s['rank']}" for s in statuses[:8]]
    more = f" and {len(statuses) - 8} more" if len(statuses) > 8 else ""
    return ", ".join(shown) + more


# --- errors the guard maps to HTTP statuses --------------------------------------------------


class InfoError(InvalidArgument):
    """A payload is malformed (HTTP 400; `field` names the first field at fault)."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        text = "; ".join(str(p) for p in problems)
        super().__init__(
            f"invalid refitplane weight-transfer request: {text}", field=problems[0].field
        )
        self.problems = list(problems)


class StateConflict(FailedPrecondition):
    """The verb does not fit the engine's state (HTTP 409): nothing was sent to the workers,
    or (finish) the update was closed but no version was set."""


class EngineFailed(TransferError):
    """The workers ran the verb and at least one failed (HTTP 500, or 409 when every failed
    rank failed for a reason the caller controls)."""

    def __init__(self, message: str, *, caller_fault: bool = False) -> None:
        super().__init__(message)
        self.caller_fault = caller_fault


class DraftUnsupported(RefitError):
    """This replica does not refit a draft (speculative / MTP) model (HTTP 501)."""

    reason: str = Reason.UNIMPLEMENTED


# Reasons a rank records that come from the request, not from the system.
_CALLER_REASONS: Final = frozenset(
    {Reason.FAILED_PRECONDITION, Reason.INVALID_ARGUMENT, Reason.NOT_FOUND}
)


# --- the flows ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rpc:
    """`collective_rpc(method, kwargs=kwargs)` to every worker; the result is the replies."""

    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GetVersion:
    """The engine core's current weight version (a str)."""


@dataclass(frozen=True)
class SetVersion:
    version: str


@dataclass(frozen=True)
class ClearPrefixCache:
    """The engine's prefix cache cleared, once an update changed the weights; the result is
    whether it was (`LLM.reset_prefix_cache()`), or None where the caller's pause already
    did (a server's /pause, `AsyncLLM.pause_generation`: the async driver)."""


@dataclass(frozen=True)
class FlowOutcome:
    # finish: an applied update that no version was set for yet (a later
    # update_weight_version may name it); None: unchanged.
    unlabeled: bool | None = None


Step = Rpc | GetVersion | SetVersion | ClearPrefixCache
# A flow yields steps, is sent each step's result, and returns its outcome.
Flow = Generator[Step, Any, FlowOutcome]
STATUS: Final = Rpc(ENGINE_ATTR, {"op": "status"})
DISCARD: Final = Rpc(ENGINE_ATTR, {"op": "discard"})
CLEAR_PREFIX_CACHE: Final = ClearPrefixCache()


def init_flow(init_info: Any) -> Flow:
    _, problems = parse_init_info(init_info)
    if problems:
        raise InfoError(problems)
    yield Rpc("init_weight_transfer_engine", {"init_info": init_info})
    statuses = read_statuses((yield STATUS))
    failed = [s for s in statuses if not s["initialized"] or s["error"]]
    if failed:
        errors = sorted({s["error"] or "not initialised" for s in failed})
        raise EngineFailed(
            f"the refitplane engine did not start on {_who(failed)}: {'; '.join(errors)}"
        )
    return FlowOutcome()


def start_flow(*, draft: bool = False) -> Flow:
    """`draft`: vLLM's /start_draft_weight_update. Where every rank refits its draft, the
    session is an ordinary one (the coordinator's refit moves target and draft together,
    one version); vLLM's own draft session, which would load only the draft, is not
    opened."""
    statuses = read_statuses((yield STATUS))
    if draft:
        _check_draft_refit(statuses)
    uninitialised = [s for s in statuses if not s["initialized"]]
    if uninitialised:
        raise StateConflict(
            f"call /init_weight_transfer_engine first: the engine is not initialised on "
            f"{_who(uninitialised)}"
            + (f" ({uninitialised[0]['error']})" if uninitialised[0]["error"] else "")
        )
    _refuse_while_open(statuses, "first")
    yield Rpc("start_weight_update")
    return FlowOutcome()


def _refuse_while_open(statuses: Sequence[EngineStatus], when: str) -> None:
    """409 naming the ranks where an update is open: the caller must call
    /finish_weight_update `when` ("first", "before /shutdown_...")."""
    active = [s for s in statuses if s["session"]]
    if active:
        raise StateConflict(
            f"a weight update is in progress on {_who(active)}; call /finish_weight_update {when}"
        )


def _check_draft_refit(statuses: Sequence[EngineStatus]) -> None:
    not_refit = [s for s in statuses if s["initialized"] and s["draft"] != "refit"]
    if not not_refit:
        return
    why = {
        "none": "it serves no draft model with weights (no speculative_config model)",
        "keep": 'its engine keeps the draft as loaded (init_info.draft "keep", the default; '
        'init with "refit" to refit it with the target)',
    }.get(not_refit[0]["draft"], "its engine did not describe a draft")
    raise DraftUnsupported(
        f"draft weight updates: {_who(not_refit)} cannot take one: {why}. refitplane refits "
        "a draft only together with its target, in the ordinary weight update "
        "(docs/vllm-integration.md, Draft models)"
    )


def update_flow(update_info: Any) -> Flow:
    payloads = update_info if isinstance(update_info, list) else [update_info]
    problems: list[Problem] = []
    for i, payload in enumerate(payloads):
        where = f"update_info[{i}]" if isinstance(update_info, list) else "update_info"
        problems += parse_update_info(payload, where=where)[1]
    if not payloads:
        problems.append(Problem("update_info", "must not be an empty list"))
    if problems:
        raise InfoError(problems)
    before = read_statuses((yield STATUS))
    idle = [s for s in before if not s["session"]]
    if idle:
        raise StateConflict(
            f"call /start_weight_update before /update_weights: no weight update is in "
            f"progress on {_who(idle)}"
        )
    seen = [len(s["updates"]) for s in before]
    yield Rpc("update_weights", {"update_info": update_info})
    after = read_statuses((yield STATUS))
    failed: list[tuple[EngineStatus, UpdateRecord | None]] = []
    for count, status in zip(seen, after, strict=False):
        record = status["updates"][count] if len(status["updates"]) > count else None
        if record is None or not record["ok"]:
            failed.append((status, record))
    if failed:
        lines = [
            f"{_who([s])}: "
            + (f"{r['reason']}: {r['message']}" if r else "recorded no outcome for this update")
            for s, r in failed
        ]
        caller = all(r is not None and r["reason"] in _CALLER_REASONS for _, r in failed)
        refits = sorted({r["refit_id"] for _, r in failed if r and r["refit_id"]})
        raise EngineFailed(
            f"refit {', '.join(refits) or '?'} did not verify on {len(failed)} of "
            f"{len(after)} rank(s): " + "; ".join(lines),
            caller_fault=caller,
        )
    return FlowOutcome()


def finish_flow(weight_version: str | None) -> Flow:
    before = read_statuses((yield STATUS))
    idle = [s for s in before if not s["session"]]
    if idle:
        raise StateConflict(
            f"no weight update is in progress on {_who(idle)}: call /start_weight_update first"
        )
    unverified = [s for s in before if any(not u["ok"] for u in s["updates"])]
    if unverified or any(s["discarded"] for s in before):
        # One rank's failure means no rank may apply: the replica must not mix versions.
        yield DISCARD
    yield Rpc("finish_weight_update")
    after = read_statuses((yield STATUS))
    broken = [s for s in after if s["incomplete"]]
    if broken:
        yield SetVersion(INCOMPLETE_VERSION)
        raise EngineFailed(
            f"the replica holds weights that no verified update produced ({_who(broken)}: "
            f"{broken[0]['last_message'] or broken[0]['last']}); weight_version is now "
            f"{INCOMPLETE_VERSION!r} until an update applies on every rank"
        )
    if all(s["last"] == "applied" for s in after):
        # The prefix cache holds keys and values computed with the weights just replaced.
        # An offline `LLM` has no pause that would have cleared it: a prompt sharing a
        # cached block would be served from the old weights under the new version.
        if (yield CLEAR_PREFIX_CACHE) is False:
            yield SetVersion(INCOMPLETE_VERSION)
            raise EngineFailed(
                "the update applied, but vLLM could not clear its prefix cache (requests "
                "still running?): cached prompts would be served from the old weights; "
                f"weight_version is now {INCOMPLETE_VERSION!r} until an update applies"
            )
        if weight_version is not None:
            yield SetVersion(weight_version)
            return FlowOutcome(unlabeled=False)
        return FlowOutcome(unlabeled=True)
    if weight_version is None:
        return FlowOutcome(unlabeled=False)
    current = yield GetVersion()
    not_applied = [s for s in after if s["last"] != "applied"]
    why = sorted(
        {f"{s['last']}{': ' + s['last_message'] if s['last_message'] else ''}" for s in not_applied}
    )
    raise StateConflict(
        f"weight_version {weight_version!r} was not set: the update was not applied on "
        f"{_who(not_applied)} ({'; '.join(why)}); the replica still serves {current!r}"
    )


def update_version_flow(new_version: str, *, unlabeled: bool) -> Flow:
    statuses = read_statuses((yield STATUS))
    broken = [s for s in statuses if s["incomplete"]]
    if broken:
        raise StateConflict(
            f"weight_version {new_version!r} not set: {_who(broken)} hold weights that no "
            "verified update produced"
        )
    current = yield GetVersion()
    as_loaded = all(s["applied_sessions"] == 0 for s in statuses)
    if new_version == current or unlabeled or as_loaded:
        yield SetVersion(new_version)
        return FlowOutcome(unlabeled=False)
    raise StateConflict(
        f"weight_version {new_version!r} not set: no verified update was applied since "
        f"version {current!r} (refitplane sets the version of an update it verified; "
        "pass weight_version to /finish_weight_update)"
    )


def shutdown_flow() -> Flow:
    statuses = read_statuses((yield STATUS))
    _refuse_while_open(statuses, "before /shutdown_weight_transfer_engine")
    yield Rpc("shutdown_weight_transfer_engine")
    return FlowOutcome()
