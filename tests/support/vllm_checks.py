"""Checks that run inside every vLLM worker (`llm.collective_rpc(check_worker_layout, ...)`).

`check_worker_layout` describes the worker's parameters with `describe_vllm_model`, loads the
checkpoint with the model's own `load_weights` into loader-format copies
(`loaded_reference`), and checks the description against that ground truth:

- every registered view (canonical tensor, box) equals `checkpoint[tensor][box]`;
- placements plus padding cover every parameter element exactly once (counted element by
  element, independently of the layout's own check) and the loader wrote every element;
- padding regions are zero, as `load_weights` leaves them;
- the boxes are all the loader reads: whole-shape tensors holding only this rank's boxes
  (zeros elsewhere) load to exactly what the full checkpoint loads to;
- the loader-format shapes equal those vLLM recorded at `create_weights` time;
- live parameters judged writable in place (`vllm_live.live_storage`) equal the reference,
  and `vllm_shards(model)` without extra storage works exactly when all of them are.

`reload_from_boxes` then replaces the live weights through vLLM's layerwise reload from only
this rank's boxes of another checkpoint, the way a refit reloads where it cannot write in
place. `check_worker_layout` returns a JSON-able report (failures as strings, plus the boxes each rank needs) so the
test process can also check properties across ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from refitplane.errors import LayoutError
from refitplane.generator.checkpoint_index import safetensors_specs
from refitplane.generator.vllm_describe import describe_vllm_model, vllm_shards
from refitplane.generator.vllm_layout import VllmLayout
from refitplane.generator.vllm_live import live_storage
from refitplane.generator.vllm_reload import reload_weights
from refitplane.generator.vllm_staging import ModelPart, ReceiveBinding, bind_receive
from refitplane.models.tiny import load_checkpoint
from refitplane.reshard.boxes import format_box, to_slices
from refitplane.reshard.stages import stage_of
from tests.support.refit_checks import parameter_digests
from tests.support.vllm_reference import loaded_reference, unwritten


def describe_worker(
    worker: Any, checkpoint_dir: str, skip_rules: Sequence[str] = (), draft: bool = False
) -> VllmLayout:
    """`describe_vllm_model` of the worker's model (its speculative-decoding draft model
    with `draft`), tracing fallback layers with the checkpoint in `checkpoint_dir`;
    `skip_rules` switches fast-path rules off by class. A draft is described less what it
    shares with the target (EAGLE / MTP heads use the target's embedding), as the engine
    publishes it (EAGLE heads named as their checkpoints name them)."""
    from refitplane.generator.vllm_draft import draft_checkpoint_namer

    specs = safetensors_specs(checkpoint_dir)
    speculative = worker.vllm_config.speculative_config
    method = str(getattr(speculative, "method", "")) if draft else ""
    return describe_vllm_model(
        served_model(worker, draft),
        checkpoint=specs,
        vllm_config=worker.vllm_config,
        skip_rules=skip_rules,
        shared_with=served_model(worker) if draft else None,
        to_hf_name=draft_checkpoint_namer(method, frozenset(specs)),
    )


def served_model(worker: Any, draft: bool = False) -> Any:
    """The worker's model, or with `draft` its speculative-decoding draft model."""
    runner = worker.model_runner
    return runner.get_draft_model() if draft else runner.get_model()


def check_worker_layout(
    worker: Any, checkpoint_dir: str, skip_rules: Sequence[str] = (), draft: bool = False
) -> dict[str, Any]:
    """Run in a vLLM worker; returns the report described in the module docstring (for the
    draft model with `draft`; `checkpoint_dir` is then the draft's checkpoint)."""
    model = served_model(worker, draft)
    checkpoint = load_checkpoint(checkpoint_dir)
    layout = describe_worker(worker, checkpoint_dir, skip_rules, draft)
    reference = loaded_reference(model, layout, checkpoint.items())
    failures: list[str] = []
    failures += _check_views(layout, reference, checkpoint)
    failures += _check_cover(layout, reference)
    failures += _check_recorded_shapes(model, layout)
    # The boxes are all the loader reads: loading whole-shape tensors that hold only this
    # rank's boxes (zeros elsewhere) writes exactly what the full checkpoint writes.
    from_boxes = loaded_reference(model, layout, _staged_from(layout, checkpoint).items())
    failures += [
        f"{name}: loading only this rank's boxes differs from loading the checkpoint"
        for name, tensor in from_boxes.items()
        if not torch.equal(tensor, reference[name])
    ]
    live = live_storage(model, layout)
    failures += [
        f"{name}: writable in place but differs from what load_weights writes"
        for name, tensor in live.writable.items()
        if not torch.equal(tensor.detach(), reference[name])
    ]
    live_error = None
    try:
        vllm_shards(model, layout=layout)
    except LayoutError as exc:
        live_error = str(exc)
    if bool(live.blocked) != (live_error is not None):
        failures.append(
            f"binding to the live model {'failed' if live_error else 'succeeded'} with "
            f"blocked parameters {sorted(live.blocked)}: {live_error}"
        )
    staged, _ = vllm_shards(model, params=layout.allocate(), layout=layout)
    if len(staged) != sum(len(p.placements) for p in layout.params.values()):
        failures.append("binding with staging storage registered a different number of views")
    return {
        "ranks": {
            "tp_rank": layout.ranks.tp_rank,
            "tp_size": layout.ranks.tp_size,
            "pp_rank": layout.ranks.pp_rank,
        },
        "specs": {n: [list(s.shape), s.dtype] for n, s in layout.specs.items()},
        "hf_boxes": {
            n: [list(map(list, b)) for b in boxes] for n, boxes in layout.hf_boxes().items()
        },
        "padding": [
            [p.name, format_box(r.param_box), r.reason]
            for p in layout.params.values()
            for r in p.padding
        ],
        "params": sorted(layout.params),
        "fallback": {p.name: [p.reason, list(p.sources)] for p in layout.fallback.values()},
        "fallback_layers": sorted(
            {type(model.get_submodule(n.rpartition(".")[0])).__name__ for n in layout.fallback}
        ),
        "model_class": type(model).__name__,
        "summary": layout.summary(),
        "rules_moved": layout.rules_moved(),
        "blocked": dict(live.blocked),
        "writable": sorted(live.writable),
        "live_error": live_error,
        "failures": failures,
    }


def _check_views(
    layout: VllmLayout, reference: dict[str, torch.Tensor], checkpoint: dict[str, torch.Tensor]
) -> list[str]:
    failures = []
    shards, _ = layout.bind(reference)
    for sv in shards:
        tensor = checkpoint.get(sv.spec.name)
        if tensor is None:
            failures.append(f"{sv.spec.name}: registered but not in the checkpoint")
            continue
        if list(tensor.shape) != list(sv.spec.shape):
            failures.append(
                f"{sv.spec.name}: spec {list(sv.spec.shape)} vs checkpoint {list(tensor.shape)}"
            )
            continue
        if not torch.equal(sv.tensor, tensor[to_slices(sv.box)]):
            failures.append(f"{sv.spec.name}{format_box(sv.box)}: view differs from the checkpoint")
    return failures


def _check_cover(layout: VllmLayout, reference: dict[str, torch.Tensor]) -> list[str]:
    failures = []
    for param in layout.params.values():
        count = torch.zeros(param.shape, dtype=torch.int32)
        for placement in param.placements:
            placement.view(count).add_(1)
        for region in param.padding:
            count[to_slices(region.param_box)] += 1
        if not bool((count == 1).all()):
            bad = int((count != 1).sum())
            failures.append(f"{param.name}: {bad} elements not covered exactly once")
        loaded = reference[param.name]
        if bool(unwritten(loaded).any()):
            failures.append(f"{param.name}: load_weights left elements unwritten")
        for region in param.padding:
            if bool((loaded[to_slices(region.param_box)] != 0).any()):
                failures.append(f"{param.name}{format_box(region.param_box)}: padding not zero")
    return failures


def _check_recorded_shapes(model: torch.nn.Module, layout: VllmLayout) -> list[str]:
    """Loader-format shapes against those vLLM recorded when `create_weights` ran (vLLM
    records no metadata for tensors it never moves to the meta device, such as `bias`,
    which are never repacked: those are compared with the live tensor)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    failures = []
    for name, param in layout.params.items():
        path, _, pname = name.rpartition(".")
        owner = model.get_submodule(path)
        info = LAYERWISE_INFO.get(owner)
        recorded = info.restore_metadata[0].get(pname) if info is not None else None
        if recorded is None and pname in SKIP_TENSORS:
            recorded = getattr(owner, pname)
        if recorded is None:
            failures.append(f"{name}: vLLM recorded no loader-format metadata")
        elif tuple(recorded.shape) != param.shape:
            failures.append(
                f"{name}: described {list(param.shape)}, vLLM recorded {list(recorded.shape)}"
            )
    return failures


def reload_from_boxes(worker: Any, checkpoint_dir: str, skip_rules: Sequence[str] = ()) -> int:
    """Replace the worker's weights with a checkpoint's through `vllm_reload.reload_weights`,
    given only this rank's boxes of each tensor (the reload path of a refit where parameters
    cannot be written in place). Returns the number of boxes loaded."""
    model = worker.model_runner.get_model()
    layout = describe_worker(worker, checkpoint_dir, skip_rules)
    staging = _staged_from(layout, load_checkpoint(checkpoint_dir))
    reload_weights(model, worker.vllm_config, staging.items())
    return sum(len(boxes) for boxes in layout.hf_boxes().values())


def _staged_from(
    layout: VllmLayout, checkpoint: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Whole-shape staging tensors holding only this rank's boxes of `checkpoint`."""
    shards, staging = layout.checkpoint_staging()
    for sv in shards:
        sv.tensor.copy_(checkpoint[sv.spec.name][to_slices(sv.box)])
    return staging


def receive_like_the_engine(
    worker: Any, checkpoint_dir: str = "", skip_rules: Sequence[str] = ()
) -> dict[str, Any]:
    """The engine's receive path without a transfer, then vLLM's own full reload, compared.

    In the worker: `receive_checkpoint` (the engine's binding, filled from the checkpoint or
    from synthetic weights, applied as the transfer and `finish_weight_update` do), then the
    digest of every parameter and buffer as the kernels read them; then the whole checkpoint
    reloaded through vLLM's layerwise reload and the digests again. This compares with
    vLLM's reload, whose bugs the refit's own fixes do not share: the fresh-load oracle
    (`tests.support.fresh_load`) is the one that judges; this one locates a difference.
    """
    report, tensors = _receive(worker, checkpoint_dir, "auto", skip_rules)
    return {**report, **_reload_differences(worker, tensors)}


def reload_differences(worker: Any, checkpoint_dir: str) -> dict[str, Any]:
    """In a worker that has received `checkpoint_dir` (`receive_checkpoint`): the second half
    of `receive_like_the_engine` — digests of every parameter and buffer, vLLM's own full
    reload of the checkpoint, digests again. Returns the digest count and the names that
    differ. test_fresh_load_gpu.py runs it in its "auto" engine once its fresh-load check is
    done, so test_model_coverage_gpu.py needs no engine of its own."""
    device = next(worker.model_runner.get_model().parameters()).device
    tensors = [(n, t.to(device)) for n, t in load_checkpoint(checkpoint_dir).items()]
    return _reload_differences(worker, tensors)


def _reload_differences(worker: Any, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    received = parameter_digests(worker)
    reload_weights(worker.model_runner.get_model(), worker.vllm_config, tensors)
    reloaded = parameter_digests(worker)
    return {
        "digests": len(received),
        "differ": sorted(n for n in reloaded if received.get(n) != reloaded[n]),
    }


def receive_checkpoint(
    worker: Any, checkpoint_dir: str = "", mode: str = "auto", skip_rules: Sequence[str] = ()
) -> dict[str, Any]:
    """In the worker: describe the model as the engine does (checkpoint index from
    `checkpoint_dir`, or from the served model's config when empty: dummy-weight GPU runs),
    bind the same storage the engine binds for receive `mode` (`vllm_staging.bind_receive`:
    live fast-path parameters where the kernels read them as loaded, staging a bucket of
    layers at a time elsewhere, fallback tensors whole; "staged": everything staged), fill
    every view with its box of the checkpoint (`checkpoint_dir`'s tensors, or the synthetic
    tensors of `synthetic_weights`) bucket by bucket, applying each one as the transfer and
    `finish_weight_update` do. Returns the mode, bucket count, summary and fallback reasons."""
    return _receive(worker, checkpoint_dir, mode, skip_rules)[0]


def _receive(
    worker: Any, checkpoint_dir: str, mode: str, skip_rules: Sequence[str]
) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """`receive_checkpoint`, and the tensors it received from."""
    from refitplane.generator.checkpoint_index import CheckpointIndex, checkpoint_specs

    model = worker.model_runner.get_model()
    device = next(model.parameters()).device
    index = (
        CheckpointIndex(safetensors_specs(checkpoint_dir))
        if checkpoint_dir
        else checkpoint_specs(worker.model_config)
    )
    layout = describe_vllm_model(
        model, checkpoint=index, vllm_config=worker.vllm_config, skip_rules=skip_rules
    )
    binding = bind_receive(
        [ModelPart(model, layout, worker.vllm_config)], device=device, requested=mode
    )
    tensors = _tensors(worker, checkpoint_dir, layout)
    buckets = receive_without_transfer(binding, dict(tensors))
    report = {
        "mode": binding.mode,
        "buckets": buckets,
        "summary": layout.summary(),
        "fallback": sorted({p.reason for p in layout.fallback.values()}),
    }
    return report, tensors


def _tensors(
    worker: Any, checkpoint_dir: str, layout: VllmLayout
) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors on the worker's device (`checkpoint_dir`), or the synthetic
    tensors of every checkpoint tensor `layout` names."""
    from refitplane.testing.synthetic_weights import synthetic

    model = worker.model_runner.get_model()
    device = next(model.parameters()).device
    if checkpoint_dir:
        return [(n, t.to(device)) for n, t in load_checkpoint(checkpoint_dir).items()]
    return [(n, synthetic(n, s.shape, s.dtype, device)) for n, s in layout.specs.items()]


def receive_without_transfer(binding: ReceiveBinding, tensors: dict[str, torch.Tensor]) -> int:
    """Fill `binding`'s views with their boxes of `tensors` as a transfer would — live views
    first, staged tensors bucket by bucket in stage order, each bucket applied once filled,
    the last one by the finish — and finish as `finish_weight_update` does. Returns the
    number of buckets."""
    staged = binding.staged
    if staged is None:
        for sv in binding.shards:
            sv.tensor.copy_(tensors[sv.spec.name][to_slices(sv.box)])
        binding.reloader.finish()
        return 0
    for spec, box, view in staged.resident():
        view.copy_(tensors[spec.name][to_slices(box)])
    by_stage: dict[tuple[str, int], list[str]] = {}
    for name in sorted(staged.staged_names):
        by_stage.setdefault(stage_of(name), []).append(name)
    buckets = staged.plan(sorted(by_stage.items()))
    binding.reloader.begin()
    staged.begin(buckets)
    for bucket in buckets:
        if staged.held is not None:
            staged.close(staged.held)
        staged.open(bucket)
        for name in bucket.names:
            for sv in staged.views_of(name):
                staged.view(name, sv.box).copy_(tensors[name][to_slices(sv.box)])
    staged.apply_held()
    binding.reloader.finish()
    return len(buckets)


def check_attention_refresh(worker: Any) -> dict[str, Any]:
    """In a vLLM worker: the refresh a refit's finish runs (`refresh_attention_layers`), then
    the post-load processing of every attention layer run anyway, the skipped ones included:
    what that changes in any parameter or buffer shows a layer skipped wrongly."""
    import itertools

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from refitplane.generator.vllm_reload import refresh_attention_layers

    model = worker.model_runner.get_model()
    config = worker.vllm_config

    def tensors() -> dict[str, torch.Tensor]:
        named = itertools.chain(model.named_parameters(), model.named_buffers())
        return {name: t.detach().clone() for name, t in named}

    processed = refresh_attention_layers(model, config)
    before = tensors()
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    with set_current_vllm_config(config):
        for layer in layers:
            layer.process_weights_after_loading(config.model_config.dtype)
    after = tensors()
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    return {"layers": len(layers), "processed": processed, "changed": changed}


def receive_with_draft(worker: Any, target_dir: str, draft_dir: str) -> dict[str, Any]:
    """In a worker serving a speculative draft: describe target and draft exactly as the
    engine does with `init_info.draft = "refit"` (`vllm_draft.draft_part`: the worker's own
    draft, same rules and start-up check, shared parameters left to the target, names
    under `draft.`), bind both for receive as the engine does, fill every view from the
    target's checkpoint and the draft's (`draft_dir`; the same directory for MTP) and apply
    as the transfer and `finish_weight_update` do. Returns the mode, the draft's summary and
    what the worker reports about its draft."""
    from refitplane.generator.vllm_draft import install
    from refitplane.protocol.draft import draft_name

    target = worker.model_runner.get_model()
    device = next(target.parameters()).device
    layout, served, state, part = describe_with_draft(worker, target_dir)
    binding = bind_receive(
        [ModelPart(target, layout, worker.vllm_config), part], device=device, requested="auto"
    )
    tensors = {n: t.to(device) for n, t in load_checkpoint(target_dir).items()}
    tensors.update({draft_name(n): t.to(device) for n, t in load_checkpoint(draft_dir).items()})
    buckets = receive_without_transfer(binding, tensors)
    return {
        "mode": binding.mode,
        "buckets": buckets,
        "draft": state,
        "draft_class": type(served.model).__name__ if served is not None else "",
        "method": served.method if served is not None else "",
        "draft_summary": part.layout.summary(),
        "draft_fallback": sorted({p.reason for p in part.layout.fallback.values()}),
        # The worker verb the engine needs to find its draft is wrapped (vllm_draft.install).
        "verb_wrapped": install(),
    }


def describe_with_draft(worker: Any, target_dir: str) -> tuple[VllmLayout, Any, str, ModelPart]:
    """The worker's target described from `target_dir`'s checkpoint, and its draft (found
    through vLLM's worker) described as the engine does with `init_info.draft = "refit"`
    (`vllm_draft.draft_part`): the target's layout, the served draft, the draft state and
    the draft's part."""
    from refitplane.generator.vllm_draft import draft_part, find_draft
    from refitplane.generator.vllm_rule_check import RuleCheckPolicy

    target = worker.model_runner.get_model()
    layout = describe_vllm_model(
        target, checkpoint=safetensors_specs(target_dir), vllm_config=worker.vllm_config
    )
    served = find_draft(worker)
    state, part = draft_part(
        lambda: served,
        "refit",
        target=target,
        target_layout=layout,
        skip_rules=[],
        rule_check=RuleCheckPolicy(),
    )
    assert part is not None
    return layout, served, state, part
