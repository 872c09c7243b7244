"""A model loader that transforms a tensor in a way no fast-path rule models, for tests.

`permuted_loader(tmp, suffix)` installs a vLLM general plugin (an entry point in a
`*.dist-info` folder put on the path, so every vLLM process, spawned workers included,
loads it) that reverses the rows of every checkpoint tensor whose name ends with `suffix`
before vLLM's `AutoWeightsLoader` hands it to the layers — as Llama 4's `load_weights`
permutes q/k rows for its rotary layout. The layer class's rule then describes the plain
slice: wrong bytes, which only the start-up check of the rules (`vllm_rule_check`) catches.
It applies to the fresh load, the engine's reloads and the tests' reference loads alike, so
the model's "truth" is the permuted load.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

# The checkpoint-name suffix whose rows the loader reverses; unset: the plugin does nothing.
ENV = "REFIT_TEST_REVERSED_ROWS"
_DIST = "refitplane_test_reversed_rows-0.0.dist-info"


def register() -> None:
    """vLLM general plugin: wrap `AutoWeightsLoader.load_weights` if `ENV` names a suffix."""
    suffix = os.environ.get(ENV, "")
    if not suffix:
        return
    from vllm.model_executor.models.utils import AutoWeightsLoader

    original = AutoWeightsLoader.load_weights
    if getattr(original, "reversed_rows", None) == suffix:
        return

    depth = [0]

    def load_weights(self: Any, weights: Iterable[tuple[str, Any]], **kwargs: Any) -> Any:
        # AutoWeightsLoader calls itself for submodules (`model.` prefix stripped): reverse
        # at the outermost call only, once per tensor.
        if depth[0] == 0:
            weights = ((n, t.flip(0) if n.endswith(suffix) else t) for n, t in weights)
        depth[0] += 1
        try:
            return original(self, weights, **kwargs)
        finally:
            depth[0] -= 1

    load_weights.reversed_rows = suffix  # type: ignore[attr-defined]
    AutoWeightsLoader.load_weights = load_weights  # type: ignore[method-assign]


@contextlib.contextmanager
def permuted_loader(folder: Path, suffix: str) -> Iterator[dict[str, str]]:
    """Install the plugin under `folder`; yields the environment a `vllm_cpu_engine` needs
    (`env=`) for its processes to load it with `suffix`. The path entry goes on exit."""
    dist = folder / _DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: refitplane-test-reversed-rows\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\nreversed_rows = {__name__}:register\n"
    )
    root = str(folder)
    sys.path.insert(0, root)
    try:
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        yield {ENV: suffix, "PYTHONPATH": path}
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(root)
