"""`OfflineLLMControl.pause` clears the offline engine's prefix cache (a server's /pause
does; an offline `LLM` has none), and answers 500 where vLLM cannot clear it —
`LLM.reset_prefix_cache()` returns False while requests still run — so the refit fails in
PREPARING, before any byte moves. What clearing does to served tokens is proven against a
fresh load with a real engine (`tests/integration/generator/test_offline_prefix_cache_cpu.py`);
here vLLM's answer is stood in, to pin the status each answer becomes."""

from __future__ import annotations

import pytest

from refitplane.generator.offline_control import OfflineLLMControl


class _LLM:
    def __init__(self, cleared: bool | None) -> None:
        self.cleared = cleared
        self.calls = 0

    def reset_prefix_cache(self) -> bool | None:
        self.calls += 1
        return self.cleared


@pytest.mark.parametrize(("cleared", "status"), [(True, 200), (None, 200), (False, 500)])
def test_pause_clears_the_prefix_cache_or_fails(cleared: bool | None, status: int) -> None:
    llm = _LLM(cleared)
    assert OfflineLLMControl(llm).pause("keep") == status
    assert llm.calls == 1
