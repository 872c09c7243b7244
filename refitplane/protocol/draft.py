"""How a speculative-decoding draft's tensors are named on the wire.

A generator that serves a draft (a small draft LM, an EAGLE head, DeepSeek-V3's MTP layers)
and refits it publishes the draft's canonical tensors beside the target's, in the same
layout of the same rank, so one refit moves target and draft under one version. The
draft's checkpoint names collide with the target's (a draft Qwen3 has its own
`model.layers.0...`; MTP layers are `model.layers.<num_hidden_layers + i>...` of the target's
own checkpoint), so every draft tensor carries `DRAFT_PREFIX`:

    draft.model.layers.0.self_attn.q_proj.weight      the draft's layer 0
    draft.model.layers.61.eh_proj.weight              DeepSeek-V3's first MTP layer

Trainers publish the draft's shards under the same names (`TrainerAgent(...,
draft_shards=...)`). No target tensor may start with the prefix: a checkpoint that has one
is refused at the generator's start (`target_name_problem`), so a name is never ambiguous.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from refitplane.errors import LayoutError
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import LocalShards

DRAFT_PREFIX: Final = "draft."


def draft_name(name: str) -> str:
    """The wire name of the draft's checkpoint tensor `name`."""
    return DRAFT_PREFIX + name


def is_draft_name(name: str) -> bool:
    return name.startswith(DRAFT_PREFIX)


def checkpoint_name(name: str) -> str:
    """The draft checkpoint's own name of wire name `name` (unchanged for a target tensor)."""
    return name.removeprefix(DRAFT_PREFIX)


def target_name_problem(names: Iterable[str]) -> str:
    """Why target tensors named `names` cannot be published beside a draft ("" if they can)."""
    clashing = sorted(n for n in names if is_draft_name(n))
    if not clashing:
        return ""
    return (
        f"target tensor {clashing[0]!r} (and {len(clashing) - 1} more) starts with "
        f"{DRAFT_PREFIX!r}, the prefix that marks a speculative draft's tensors"
    )


def with_draft(target: LocalShards, draft: LocalShards) -> LocalShards:
    """One registry holding `target`'s views and `draft`'s under `DRAFT_PREFIX` (the same
    memory: nothing is copied). What a trainer rank publishes when it holds a draft too."""
    problem = target_name_problem(target.names())
    if problem:
        raise LayoutError(problem, field="shards")
    both = LocalShards()
    for view in target:
        both.add(view.spec, view.box, view.tensor)
    for view in draft:
        spec = TensorSpec(draft_name(view.spec.name), view.spec.shape, view.spec.dtype)
        both.add(spec, view.box, view.tensor)
    return both
