"""Tracing a model's own `load_weights` (the fallback path's way of finding what a layer
loads) and reading a checkpoint's tensor index, without vLLM: a torch module with a
vLLM-style `load_weights` (name mapping, stacked parameters, keyword loaders)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from refitplane.errors import LayoutError
from refitplane.generator.checkpoint_index import safetensors_specs
from refitplane.generator.vllm_load_trace import (
    persistent_buffers,
    trace_load_targets,
    traced_checkpoint_tensor,
)
from refitplane.reshard.layout import TensorSpec

pytestmark = pytest.mark.unit


def spec(name: str, *shape: int) -> TensorSpec:
    return TensorSpec.create(name, list(shape), "float32")


class ToyModel(torch.nn.Module):
    """Loads like a vLLM model: q/k stacked into `qk` through a loader taking a shard id,
    `A` loaded from `A_log` transformed (-exp), `D` without a loader of its own (the
    default copy), and experts through a keyword-called loader returning success."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(6, 2), requires_grad=False)
        self.qk.weight_loader = self._stacked_loader  # type: ignore[attr-defined]
        self.A = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        self.A.weight_loader = lambda p, w: p.data.copy_(-torch.exp(w))  # type: ignore[attr-defined]
        self.D = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        self.w13 = torch.nn.Parameter(torch.zeros(2, 4, 2), requires_grad=False)
        self.w13.weight_loader = self._expert_loader  # type: ignore[attr-defined]
        self.strict = strict

    def _stacked_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        rows = (0, 4) if shard == "q" else (4, 6)
        param.data[rows[0] : rows[1]].copy_(loaded)

    def _expert_loader(
        self, *, param: torch.Tensor, loaded_weight: torch.Tensor, expert_id: int, half: int
    ) -> bool:
        param.data[expert_id, 2 * half : 2 * half + 2].copy_(loaded_weight)
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name in ("q.weight", "k.weight"):
                self.qk.weight_loader(self.qk, tensor, name[0])  # type: ignore[operator]
                loaded.add("qk")
            elif name == "A_log":
                self.A.weight_loader(self.A, tensor.float())  # type: ignore[operator]
                loaded.add("A")
            elif name == "D":
                loader = getattr(self.D, "weight_loader", None)
                if loader is None:
                    self.D.data.copy_(tensor)
                else:
                    loader(self.D, tensor)
                loaded.add("D")
            elif name.startswith("experts."):
                _, expert, proj = name.split(".")[:3]
                half = 0 if proj == "gate" else 1
                self.w13.weight_loader(  # type: ignore[operator]
                    param=self.w13, loaded_weight=tensor.t().t(), expert_id=int(expert), half=half
                )
                loaded.add("w13")
            elif self.strict:
                raise ValueError(f"no parameter for {name}")
        return loaded


CHECKPOINT = {
    s.name: s
    for s in (
        spec("q.weight", 4, 2),
        spec("k.weight", 2, 2),
        spec("A_log", 3),
        spec("D", 3),
        spec("experts.0.gate", 2, 2),
        spec("experts.1.up", 2, 2),
        spec("rotary.inv_freq", 4),
    )
}


def test_traced_tensors_remember_their_sources_through_torch_ops() -> None:
    a = traced_checkpoint_tensor(spec("a", 4, 2))
    b = traced_checkpoint_tensor(spec("b", 4, 2))
    assert a.device.type == "meta"
    assert a.narrow(0, 1, 2).t().float().sources == {"a"}  # type: ignore[attr-defined]
    assert torch.cat([a, b]).sources == {"a", "b"}  # type: ignore[attr-defined]
    assert all(c.sources == {"b"} for c in b.chunk(2))  # type: ignore[attr-defined]


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "rejects-unknown-names"])
def test_trace_finds_every_parameter_a_checkpoint_tensor_lands_in(strict: bool) -> None:
    model = ToyModel(strict=strict)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loaders = {n: p.__dict__.get("weight_loader") for n, p in model.named_parameters()}
    targets = trace_load_targets(model, CHECKPOINT)
    assert targets == {
        "q.weight": {"qk"},
        "k.weight": {"qk"},
        "A_log": {"A"},
        "D": {"D"},
        "experts.0.gate": {"w13"},
        "experts.1.up": {"w13"},
    }
    # Nothing was written, every loader is back, and D still has none of its own.
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
        assert param.__dict__.get("weight_loader") is loaders[name], name
    assert "weight_loader" not in model.D.__dict__


def test_direct_writes_into_parameters_are_traced_and_write_nothing() -> None:
    class Direct(ToyModel):
        """Writes as gpt-oss does: `param.copy_(w)` and `param.data[i] = w`, no loader."""

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for name, tensor in weights:
                if name == "D":
                    self.D.data.copy_(tensor)
                else:
                    self.w13.data[int(name[-1])] = tensor.reshape(4, 2)
            return {"D", "w13"}

    model = Direct()
    targets = trace_load_targets(model, {"D": spec("D", 3), "e1": spec("e1", 8)})
    assert targets == {"D": {"D"}, "e1": {"w13"}}
    assert torch.equal(model.D, torch.zeros(3))
    assert torch.equal(model.w13, torch.zeros(2, 4, 2))


class ExpertLayer(torch.nn.Module):
    """Loads experts as vLLM's FusedMoE / RoutedExperts do under expert parallelism: the
    loader is a method of the layer, maps the global `expert_id` through the layer's
    expert map (`_map_global_expert_id_to_local_expert_id`, -1: another rank's) and skips
    one not held, reporting False when asked; a global input scale (`use_global_sf`) loads
    on every rank."""

    def __init__(self, expert_map: list[int]) -> None:
        super().__init__()
        self.expert_map = expert_map
        self.quant_method = type("GlobalScaleMethod", (), {"use_global_sf": True})()
        held = sum(e >= 0 for e in expert_map)
        self.w13_weight = torch.nn.Parameter(torch.zeros(held, 4, 2), requires_grad=False)
        self.w13_input_scale = torch.nn.Parameter(torch.zeros(()), requires_grad=False)
        for param in (self.w13_weight, self.w13_input_scale):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def _map_global_expert_id_to_local_expert_id(self, expert_id: int) -> int:
        return self.expert_map[expert_id]

    def weight_loader(
        self,
        param: torch.Tensor,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool | None:
        if weight_name.endswith("input_scale"):
            param.data.copy_(loaded_weight)
            return True if return_success else None
        local = self._map_global_expert_id_to_local_expert_id(expert_id)
        if local == -1:
            return False if return_success else None
        rows = slice(0, 2) if shard_id == "w1" else slice(2, 4)
        param.data[local, rows].copy_(loaded_weight)
        return True if return_success else None


class ExpertModel(torch.nn.Module):
    """Qwen3-MoE's expert loop: every checkpoint expert is offered to the layer's loader
    with `return_success=True`; the model keeps only what the loader reports loaded."""

    def __init__(self, expert_map: list[int]) -> None:
        super().__init__()
        self.experts = ExpertLayer(expert_map)
        self.reported: dict[str, bool | None] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            _, expert, proj = name.split(".")
            target = "w13_input_scale" if proj == "input_scale" else "w13_weight"
            param = getattr(self.experts, target)
            success = param.weight_loader(
                param,
                tensor,
                weight_name=f"experts.{target}",
                shard_id="w1" if proj == "gate" else "w3",
                expert_id=int(expert),
                return_success=True,
            )
            self.reported[name] = success
            if success:
                loaded.add(f"experts.{target}")
        return loaded


EXPERT_CHECKPOINT = {
    s.name: s
    for e in range(4)
    for s in (spec(f"experts.{e}.gate", 2, 2), spec(f"experts.{e}.up", 2, 2))
} | {"experts.3.input_scale": spec("experts.3.input_scale")}


@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_the_rank_does_not_hold_is_not_traced_as_loaded(rank: int) -> None:
    # EP 2 over 4 experts: rank 0 holds 0 and 1, rank 1 holds 2 and 3.
    expert_map = [0, 1, -1, -1] if rank == 0 else [-1, -1, 0, 1]
    held = [e for e, local in enumerate(expert_map) if local >= 0]
    model = ExpertModel(expert_map)
    targets = trace_load_targets(model, EXPERT_CHECKPOINT)
    want = {f"experts.{e}.{p}": {"experts.w13_weight"} for e in held for p in ("gate", "up")}
    # The global input scale loads on every rank, expert 3's or not.
    assert targets == want | {"experts.3.input_scale": {"experts.w13_input_scale"}}
    # The model hears what the real loader would say: not loaded, so it tries no further.
    assert {n for n, ok in model.reported.items() if not ok} == {
        f"experts.{e}.{p}" for e in range(4) if e not in held for p in ("gate", "up")
    }
    # The real loader, run for real, writes exactly the experts traced above.
    model.load_weights((n, torch.ones(s.shape)) for n, s in EXPERT_CHECKPOINT.items())
    assert torch.equal(model.experts.w13_weight, torch.ones(2, 4, 2))
    assert model.reported == {n: n in targets for n in EXPERT_CHECKPOINT}


def test_checkpoint_index_reads_safetensors_headers(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {"a.weight": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(2)},
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"c.weight": torch.zeros(5, 6).to(torch.float8_e4m3fn)},
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    assert safetensors_specs(tmp_path) == {
        "a.weight": TensorSpec("a.weight", (3, 4), "bfloat16"),
        "b": TensorSpec("b", (2,), "float32"),
        "c.weight": TensorSpec("c.weight", (5, 6), "float8_e4m3fn"),
    }


def test_checkpoint_index_refuses_a_file_that_is_not_safetensors(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(LayoutError, match="not safetensors"):
        safetensors_specs(tmp_path)


def test_writes_into_persistent_buffers_are_traced_and_write_nothing() -> None:
    class Buffered(ToyModel):
        """Loads a persistent buffer as vLLM's AutoWeightsLoader does (a plain copy): the
        Transformers backend keeps a router's e_score_correction_bias that way. A
        non-persistent buffer is runtime state and never a target."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("bias", torch.zeros(3))
            self.register_buffer("cache", torch.zeros(3), persistent=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            for name, tensor in weights:
                getattr(self, name).data.copy_(tensor)
            return {name for name, _ in weights}

    model = Buffered()
    targets = trace_load_targets(model, {"bias": spec("bias", 3)})
    assert targets == {"bias": {"bias"}}
    assert torch.equal(model.bias, torch.zeros(3))
    assert persistent_buffers(model) == {"bias": model.bias}


def test_a_sparse_checkpoint_names_every_tensor_the_trainers_hold(tmp_path: Path) -> None:
    """The FP8 benchmark's checkpoint file holds headers and a hole: the index reads from it
    every tensor of the shape, FP8 block scales included (for MoE experts the transformers
    model built from the config names none)."""
    from refitplane.testing.model_shapes import tensor_specs
    from refitplane.testing.synthetic_weights import write_sparse_checkpoint

    write_sparse_checkpoint(tmp_path, "qwen3-small", quant="fp8")
    want = {ts.name: ts for ts in tensor_specs("qwen3-small", quant="fp8")}
    assert safetensors_specs(tmp_path) == want
    assert any(name.endswith("weight_scale_inv") for name in want)
