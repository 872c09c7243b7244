"""One trainer rank that syncs vLLM through vLLM's own trainer API (refitplane backend):
a Hugging Face model under tensor parallelism over Gloo (DTensor), one AdamW step, then
`WeightTransferTrainerFactory.trainer_init(...)` / `engine.send_weights()` on every rank.

Spawned by tests (`multiprocessing` "spawn"); never raises: it puts ("done", rank, result)
or ("error", rank, traceback) on `results`.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankConfig:
    checkpoint: str
    coordinator: str
    job: str
    vllm_url: str
    world_size: int
    master_port: int
    prompt: tuple[int, ...]
    new_tokens: int
    # This rank steps its optimizer only once the refit the others' send_weights triggered
    # waits for it (-1: none): its weights must not be read before its own send_weights.
    late_rank: int = -1


def trainer_rank_main(rank: int, cfg: RankConfig, results: Any) -> None:
    try:
        results.put(("done", rank, _run(rank, cfg)))
    except BaseException as exc:
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _run(rank: int, cfg: RankConfig) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from refitplane.models.tiny import hf_greedy_tokens, load_hf_model
    from refitplane.trainer.hf_parallel import full_state_dict, parallelize_hf_causal_lm
    from refitplane.trainer.vllm_engine import RefitplaneTrainerEngine, RefitplaneTrainerInitInfo

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg.master_port))
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world_size)
    try:
        model = load_hf_model(cfg.checkpoint, dtype="float32")
        parallelize_hf_causal_lm(model, init_device_mesh("cpu", (cfg.world_size,)))
        engine = WeightTransferTrainerFactory.trainer_init(
            RefitplaneTrainerInitInfo(
                rank=rank, coordinator=cfg.coordinator, job=cfg.job, host="127.0.0.1"
            ),
            client=HTTPVLLMWeightSyncClient(cfg.vllm_url),
            source=ModuleSource(model),
        )
        if not isinstance(engine, RefitplaneTrainerEngine):
            raise TypeError(f"vLLM built a {type(engine).__name__} for the refitplane backend")
        try:
            # One step of training, the same batch on every rank (TP).
            batch = torch.tensor([list(cfg.prompt) + list(range(100, 108))] * 2)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model.train()
            model(input_ids=batch, labels=batch).loss.backward()
            if rank == cfg.late_rank:
                _until_the_refit_waits_for(engine, rank, cfg)
            optimizer.step()
            engine.send_weights()
            full = full_state_dict(model)  # collective: only to check what vLLM serves
        finally:
            engine.shutdown()
        tokens: list[int] = []
        if rank == 0:
            reference = load_hf_model(cfg.checkpoint, dtype="float32")
            reference.load_state_dict(full, strict=True)
            tokens = hf_greedy_tokens(reference, cfg.prompt, cfg.new_tokens)
        return {"tokens": tokens, "rounds": engine.rounds, "run_id": engine.run_id}
    finally:
        dist.destroy_process_group()


def _until_the_refit_waits_for(engine: Any, rank: int, cfg: RankConfig) -> None:
    """Return once this round's refit (another rank's send_weights triggered it) waits for
    this rank before reading its weights; fail if it ends without this rank's send_weights
    (it read weights this rank was still training)."""
    from refitplane.client.sync import RefitClient

    key = f"{cfg.job}:{engine.run_id}:{engine.rounds + 1}"
    deadline = time.monotonic() + 300
    with RefitClient(cfg.coordinator) as client:
        while not engine.agent.guard.refit_waiting.wait(0.05):
            for refit in client.list(cfg.job, limit=5):
                if refit.idempotency_key == key and refit.state.terminal:
                    raise AssertionError(
                        f"refit {refit.refit_id} ended {refit.state.value} before rank {rank} "
                        "called send_weights: it read weights this rank was still training"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"no refit waited for rank {rank} within 300 s")
