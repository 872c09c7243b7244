"""The contract of vLLM's weight-transfer verbs for the refitplane backend: its vocabulary.

The payloads vLLM passes to the engine (`RefitInitInfo`, `RefitUpdateInfo`), parsed without
raising (`parse_init_info`, `parse_update_info`: every `Problem` named by its field), and
what each worker's engine reports back through its status channel (`EngineStatus`,
`UpdateRecord`, `read_statuses`), with the names both sides agree on (`ENGINE_ATTR`, the
draft's attributes, `INCOMPLETE_VERSION`). The flows that run vLLM's verbs on top of these
in the API process, and the errors they raise, are `vllm_verb_flows`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypedDict, cast

from refitplane.agent.settings import AgentSettings
from refitplane.errors import TransferError

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
    # Pre-armed (the sidecar sends the update at PrepareRefit, docs/generator.md): > 0 waits
    # up to this long for the coordinator's StartTransfer of this refit to reach the worker
    # before receiving; an abort before it ends the wait at once. 0: receive now (as before).
    start_wait_s: float = 0.0


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
        "start_wait_s": (int, float),
    },
}
_MODES: Final = ("auto", "live", "layerwise", "staged")
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
    if not 0 <= update.start_wait_s <= MAX_PREPARE_WAIT_S:
        problems.append(
            Problem(
                f"{where}.start_wait_s",
                f"must be in [0, {MAX_PREPARE_WAIT_S:g}] seconds, got {update.start_wait_s}",
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
    # refitplane's staging memory held now, and at most during the last completed transfer:
    # the checkpoint tensors the worker stages (`reshard.staged`: its arena) plus the
    # executor's ring for packed messages (sized to them, `reshard.prepared_plan`). Within
    # REFIT_MAX_INFLIGHT_BYTES where layers are staged a bucket at a time.
    staging_bytes: int
    staging_peak_bytes: int
    # Whether the worker stages any checkpoint tensors at all (a registry of staged ones):
    # if not, its staging is the ring alone, fixed by its plan for the group (the sidecar
    # reads it once per group).
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
