"""One trainer rank of the demo: a Hugging Face model under real tensor (and expert)
parallelism over Gloo, trained with AdamW, served to the coordinator by a `TrainerAgent`.

The demo's driver sends commands over a queue: "step" (one optimizer step, inside
`agent.updating_weights()`), "tokens" (gather the model, greedy-generate with transformers:
the trainer's own answer to compare with vLLM's) and "stop".
"""

from __future__ import annotations

import os
import queue
import traceback
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainerConfig:
    model_dir: str
    coordinator: str
    job: str
    world_size: int
    master_port: int
    prompt: tuple[int, ...]
    new_tokens: int
    # The continuation the trainer teaches: after a few steps the greedy tokens move to it.
    target: tuple[int, ...] = (100, 101, 102, 103, 104, 105, 106, 107)
    lr: float = 1e-2


def trainer_main(rank: int, cfg: TrainerConfig, commands: Any, results: Any) -> None:
    """Entry point of a spawned trainer rank (never raises: errors go to `results`)."""
    try:
        _run(rank, cfg, commands[rank], results)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _run(rank: int, cfg: TrainerConfig, commands: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from refitplane.models.tiny import hf_greedy_tokens, load_hf_model
    from refitplane.trainer.agent import TrainerAgent
    from refitplane.trainer.hf_parallel import full_state_dict, parallelize_hf_causal_lm
    from refitplane.trainer.layouts import dtensor_shards

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg.master_port))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world_size)
    model = load_hf_model(cfg.model_dir, dtype="float32")
    parallelize_hf_causal_lm(model, init_device_mesh("cpu", (cfg.world_size,)))
    model.train()
    agent = TrainerAgent(
        coordinator=cfg.coordinator,
        job=cfg.job,
        rank=rank,
        world_size=cfg.world_size,
        shards=lambda: dtensor_shards(model.named_parameters()),
        host="127.0.0.1",
    )
    agent.start()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    # The same batch on every rank (TP): the prompt followed by the taught continuation.
    batch = torch.tensor([list(cfg.prompt) + list(cfg.target)] * 4)
    results.put(("ready", rank, len(dtensor_shards(model.named_parameters()))))
    try:
        while True:
            try:
                command = commands.get(timeout=900)
            except queue.Empty:
                raise TimeoutError("no command from the demo driver for 15 minutes") from None
            if command == "step":
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                with agent.updating_weights():
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                results.put(("stepped", rank, float(loss.detach())))
            elif command == "tokens":
                full = full_state_dict(model)  # collective: every rank takes part
                if rank == 0:
                    reference = load_hf_model(cfg.model_dir, dtype="float32")
                    reference.load_state_dict(full, strict=True)
                    results.put(
                        ("tokens", rank, hf_greedy_tokens(reference, cfg.prompt, cfg.new_tokens))
                    )
            elif command == "stop":
                break
    finally:
        agent.close()
        dist.destroy_process_group()
