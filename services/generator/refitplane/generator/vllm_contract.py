"""The contract of vLLM's weight-transfer verbs for the refitplane backend, as pure logic.

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
`SetVersion`), so the same logic drives the async server and the offline `LLM`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypedDict, cast

from refitplane.agent.settings import AgentSettings
from refitplane.errors import FailedPrecondition, InvalidArgument, RefitError, TransferError
from refitplane.protocol import Reason

# The worker attribute that holds the engine: `collective_rpc(ENGINE_ATTR, kwargs=...)`
# resolves it on every worker (vLLM looks methods up with getattr on the worker) and calls
# the engine, which answers with its status instead of raising.
ENGINE_ATTR: Final = "weight_transfer_engine"
# Where a worker's model runner keeps a speculative-decoding draft: the getter (vLLM 0.32's
# GPU and CPU runners; it unwraps CUDA-graph wrappers), else the proposer's `model`.
DRAFT_GETTER: Final = "get_draft_model"
DRAFTER_ATTR: Final = "drafter"
# What /weight_info reports while the replica holds weights that no complete, verified
# update produced (an update failed after some received bytes landed in live parameters,
# or a staged reload failed half-way): it is not a version, so no client mistakes it for one.
INCOMPLETE_VERSION: Final = "incomplete"
# Longest wait for the coordinator's PrepareRefit that an update may ask for.
MAX_PREPARE_WAIT_S: Final = 3600.0

SessionResult = Literal["none", "empty", "applied", "discarded", "failed", "incomplete"]


@dataclass
class RefitInitInfo:
    """`init_info` of the refitplane engine (each worker's view of where to register)."""

    coordinator: str = ""
    job: str = ""
    replica_id: str = ""
    # Address peers reach this worker at (default: REFIT_HOST, else the host's address).
    host: str = ""
    tls_ca: str = ""
    # How received bytes reach the weights (`vllm_staging`): "auto" is live where possible,
    # else "layerwise" (staged a bucket of layers at a time, bounded memory); "layerwise"
    # forces that reload path; "staged" stages the whole share and applies it only at
    # finish_weight_update (a failed transfer never touches the served weights).
    mode: str = "auto"
    # vLLM layer classes (e.g. "QKVParallelLinear") sent to the fallback path as if no fast
    # path existed for them: a way around a fast-path rule that is wrong for some model.
    # Default: REFIT_FALLBACK_LAYERS (comma-separated).
    fallback_layers: list[str] = field(default_factory=list)
    # A speculative-decoding draft the worker serves: "keep" it as loaded, or "refit" it
    # with the target, one version for both (its tensors published as "draft.<name>",
    # `vllm_draft`). Default: REFIT_DRAFT, else "keep".
    draft: str = ""


@dataclass
class RefitUpdateInfo:
    """`update_info` of the refitplane engine: which refit to receive (or to discard)."""

    refit_id: str = ""
    version: int = 0
    # "receive": run this rank's transfer. "discard": drop what a failed refit staged, so
    # the `finish_weight_update` that must close vLLM's update session applies nothing.
    action: str = "receive"
    # How long to wait for the coordinator's PrepareRefit of this refit to arrive.
    prepare_wait_s: float = 60.0


# Field kinds checked before a dataclass is built (the annotations are strings here).
_KINDS: Final[dict[type[Any], dict[str, tuple[type[Any], ...]]]] = {
    RefitInitInfo: {
        "coordinator": (str,),
        "job": (str,),
        "replica_id": (str,),
        "host": (str,),
        "tls_ca": (str,),
        "mode": (str,),
        "fallback_layers": (list,),
        "draft": (str,),
    },
    RefitUpdateInfo: {
        "refit_id": (str,),
        "version": (int,),
        "action": (str,),
        "prepare_wait_s": (int, float),
    },
}
_MODES: Final = ("auto", "layerwise", "staged")
# What a replica does with the draft it serves (`RefitInitInfo.draft`).
DRAFT_POLICIES: Final = ("keep", "refit")
_ACTIONS: Final = ("receive", "discard")


@dataclass(frozen=True)
class Problem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _build(cls: type[Any], payload: Any, where: str) -> tuple[Any, list[Problem]]:
    """`cls` from a JSON object, and every problem with it (never raises)."""
    if not isinstance(payload, Mapping):
        return cls(), [Problem(where, f"must be a JSON object, got {type(payload).__name__}")]
    kinds = _KINDS[cls]
    problems = [
        Problem(f"{where}.{key}", f"unknown field (known: {', '.join(kinds)})")
        for key in sorted(set(payload) - set(kinds), key=str)
    ]
    values: dict[str, Any] = {}
    for name, kind in kinds.items():
        if name not in payload:
            continue
        value = payload[name]
        # bool is an int to Python, never to a caller who sent true for a version.
        if isinstance(value, bool) or not isinstance(value, kind):
            problems.append(
                Problem(
                    f"{where}.{name}",
                    f"must be {' or '.join(k.__name__ for k in kind)}, got {type(value).__name__}",
                )
            )
            continue
        values[name] = value
    return cls(**values), problems


def parse_init_info(
    payload: Any, *, env: AgentSettings | None = None, where: str = "init_info"
) -> tuple[RefitInitInfo, list[Problem]]:
    """The engine's init info and what is wrong with it. `env` (default `AgentSettings()`:
    REFIT_COORDINATOR, REFIT_JOB, REFIT_REPLICA_ID) stands in for missing fields, as in the
    workers."""
    info, problems = _build(RefitInitInfo, payload, where)
    init = cast(RefitInitInfo, info)
    env = AgentSettings() if env is None else env
    if init.mode not in _MODES:
        problems.append(Problem(f"{where}.mode", f"must be one of {_MODES}, got {init.mode!r}"))
    if init.draft and init.draft not in DRAFT_POLICIES:
        problems.append(
            Problem(f"{where}.draft", f"must be one of {DRAFT_POLICIES}, got {init.draft!r}")
        )
    if not all(isinstance(name, str) for name in init.fallback_layers):
        problems.append(Problem(f"{where}.fallback_layers", "must be a list of layer class names"))
    for name, variable in (
        ("coordinator", "REFIT_COORDINATOR"),
        ("job", "REFIT_JOB"),
        ("replica_id", "REFIT_REPLICA_ID"),
    ):
        if not getattr(init, name) and not getattr(env, name):
            problems.append(Problem(f"{where}.{name}", f"is required (or set {variable})"))
    return init, problems


def parse_update_info(
    payload: Any, *, where: str = "update_info"
) -> tuple[RefitUpdateInfo, list[Problem]]:
    info, problems = _build(RefitUpdateInfo, payload, where)
    update = cast(RefitUpdateInfo, info)
    if update.action not in _ACTIONS:
        problems.append(
            Problem(f"{where}.action", f"must be one of {_ACTIONS}, got {update.action!r}")
        )
    elif update.action == "receive" and not update.refit_id:
        problems.append(Problem(f"{where}.refit_id", "is required to receive a refit"))
    if len(update.refit_id) > 128:
        problems.append(Problem(f"{where}.refit_id", "must be at most 128 characters"))
    if update.version < 0:
        problems.append(Problem(f"{where}.version", f"must be >= 0, got {update.version}"))
    if not 0 < update.prepare_wait_s <= MAX_PREPARE_WAIT_S:
        problems.append(
            Problem(
                f"{where}.prepare_wait_s",
                f"must be in (0, {MAX_PREPARE_WAIT_S:g}] seconds, got {update.prepare_wait_s}",
            )
        )
    return update, problems


def as_dict(info: RefitInitInfo | RefitUpdateInfo) -> dict[str, Any]:
    return dataclasses.asdict(info)


# --- what each worker's engine reports ------------------------------------------------------


class UpdateRecord(TypedDict):
    refit_id: str
    action: str
    ok: bool
    reason: str
    message: str
    # Received bytes may have landed in live parameters before the failure.
    modified: bool


class EngineStatus(TypedDict):
    rank: int
    replica: str
    initialized: bool
    error: str
    # start_weight_update was called and finish_weight_update not yet.
    session: bool
    updates: list[UpdateRecord]
    discarded: bool
    # How the last finished session ended ("none": no session finished since start).
    last: SessionResult
    last_message: str
    # Weights were modified without a verified, applied update since the last applied one.
    incomplete: bool
    applied_sessions: int
    # The version the worker fully holds: the coordinator's version of the last refit it
    # received, verified and applied (0: none since start). Never the caller's word.
    version: int
    receive_mode: str
    # Staging memory (checkpoint tensors the worker stages, `reshard.staged`) held now and
    # at most during the last transfer; 0 for a live receive without fallback layers.
    staging_bytes: int
    staging_peak_bytes: int
    # Whether the worker stages any checkpoint tensors at all (a registry of staged ones):
    # if not, both numbers above stay 0 for as long as it is registered.
    stages: bool
    # What the start-up check of the fast-path rules found, per layer class
    # (`vllm_rule_check.RuleCheck.as_dict`): status verified / mismatch / skipped, the layers
    # checked, the reason a class moved to the fallback path, seconds and bytes it cost.
    rule_checks: list[dict[str, Any]]
    # The speculative-decoding draft: "" before init, "none" (no draft with weights served),
    # "keep" (served as loaded) or "refit" (described and refit with the target).
    draft: str


def read_statuses(replies: Any) -> list[EngineStatus]:
    """The workers' replies to a status RPC, checked."""
    if not isinstance(replies, list) or not replies:
        raise TransferError(f"the engines' status reply is not a list of workers: {replies!r}")
    for reply in replies:
        if not isinstance(reply, dict) or "session" not in reply or "updates" not in reply:
            raise TransferError(
                f"a worker's weight-transfer engine answered {reply!r} to a status request; "
                "is every worker running the refitplane engine?"
            )
    return cast(list[EngineStatus], replies)


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
class FlowOutcome:
    # finish: an applied update that no version was set for yet (a later
    # update_weight_version may name it); None: unchanged.
    unlabeled: bool | None = None


Step = Rpc | GetVersion | SetVersion
# A flow yields steps, is sent each step's result, and returns its outcome.
Flow = Generator[Step, Any, FlowOutcome]
STATUS: Final = Rpc(ENGINE_ATTR, {"op": "status"})
DISCARD: Final = Rpc(ENGINE_ATTR, {"op": "discard"})


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
    active = [s for s in statuses if s["session"]]
    if active:
        raise StateConflict(
            f"a weight update is already in progress on {_who(active)}; call "
            "/finish_weight_update first"
        )
    yield Rpc("start_weight_update")
    return FlowOutcome()


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
    active = [s for s in statuses if s["session"]]
    if active:
        raise StateConflict(
            f"a weight update is in progress on {_who(active)}; call /finish_weight_update "
            "before /shutdown_weight_transfer_engine"
        )
    yield Rpc("shutdown_weight_transfer_engine")
    return FlowOutcome()
