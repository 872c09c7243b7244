"""Checks that run inside every vLLM worker (`llm.collective_rpc(check_worker_layout, ...)`).

`check_worker_layout` describes the worker's parameters with `describe_vllm_model`, loads the
checkpoint with the model's own `load_weights` into loader-format copies
(`loaded_reference`), and checks the description against that ground truth:

- every registered view (canonical tensor, box) equals `checkpoint[tensor][box]`;
- placements plus padding cover every parameter element exactly once (counted element by
  element, independently of the layout's own check) and the loader wrote every element;
- padding regions are zero, as `load_weights` leaves them;
- the loader-format shapes equal those vLLM recorded at `create_weights` time;
- live parameters still in loader format equal the reference, and binding to the live model
  works exactly when no parameter was replaced by post-load processing.

It returns a JSON-able report (failures as strings, plus the boxes each rank needs) so the
test process can also check properties across ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from refitplane.errors import LayoutError
from refitplane.testing.service_packages import ensure_service_packages

ensure_service_packages()

from refitplane.generator.vllm_layout import VllmLayout, describe_vllm_model, vllm_shards  # noqa: E402
from refitplane.models.tiny import load_checkpoint  # noqa: E402
from refitplane.reshard.boxes import format_box, to_slices  # noqa: E402
from refitplane.testing.vllm_reference import loaded_reference  # noqa: E402


def check_worker_layout(worker: Any, checkpoint_dir: str) -> dict[str, Any]:
    """Run in a vLLM worker; returns the report described in the module docstring."""
    model = worker.model_runner.get_model()
    checkpoint = load_checkpoint(checkpoint_dir)
    layout = describe_vllm_model(model)
    reference = loaded_reference(model, layout, checkpoint.items())
    failures: list[str] = []
    failures += _check_views(layout, reference, checkpoint)
    failures += _check_cover(layout, reference)
    failures += _check_recorded_shapes(model, layout)
    replaced, live_failures = _compare_live(model, layout, reference)
    failures += live_failures
    live_error = None
    try:
        vllm_shards(model)
    except LayoutError as exc:
        live_error = str(exc)
    if bool(replaced) != (live_error is not None):
        failures.append(
            f"binding to the live model {'failed' if live_error else 'succeeded'} but "
            f"replaced parameters are {replaced}: {live_error}"
        )
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
        "replaced": replaced,
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
        if bool(torch.isnan(loaded.float()).any()):
            failures.append(f"{param.name}: load_weights left elements unwritten")
        for region in param.padding:
            if bool((loaded[to_slices(region.param_box)] != 0).any()):
                failures.append(f"{param.name}{format_box(region.param_box)}: padding not zero")
    return failures


def _check_recorded_shapes(model: torch.nn.Module, layout: VllmLayout) -> list[str]:
    """Loader-format shapes against those vLLM recorded when `create_weights` ran."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    failures = []
    for name, param in layout.params.items():
        path, _, pname = name.rpartition(".")
        info = LAYERWISE_INFO.get(model.get_submodule(path))
        recorded = info.restore_metadata[0].get(pname) if info is not None else None
        if recorded is None:
            failures.append(f"{name}: vLLM recorded no loader-format metadata")
        elif tuple(recorded.shape) != param.shape:
            failures.append(
                f"{name}: described {list(param.shape)}, vLLM recorded {list(recorded.shape)}"
            )
    return failures


def _compare_live(
    model: torch.nn.Module, layout: VllmLayout, reference: dict[str, torch.Tensor]
) -> tuple[list[str], list[str]]:
    """(parameters replaced by post-load processing, failures among the others)."""
    live = dict(model.named_parameters())
    replaced, failures = [], []
    for name, param in layout.params.items():
        tensor = live[name]
        if tuple(tensor.shape) != param.shape:
            replaced.append(name)
        elif not torch.equal(tensor.detach(), reference[name]):
            failures.append(f"{name}: live parameter differs from what load_weights writes")
    return replaced, failures
