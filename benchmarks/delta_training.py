#!/usr/bin/env python3
"""How much of a refit changes between RL steps: a real training loop, refit for real.

A small Qwen3 (transformers, random init at the config's `initializer_range`) trains with
AdamW on random token batches, fp32 master weights; after every step the trainer publishes
the master weights cast to bf16 and triggers a refit with `REFIT_DELTA=auto` through a real
coordinator (embedded store, gRPC on loopback) into a reference generator replica at TP 2
(Gloo; trainer TP1, so every refit reshards). For each step and learning rate this prints
the fraction of bf16 elements that changed, the bytes the refit put on the wire against the
full refit's (the refit record's `bytes_on_wire` / `bytes_total`), which path the replica
took, and checks that the generator holds exactly the published bytes.

    python benchmarks/delta_training.py [--steps 20] [--lr 1e-6 1e-5] [--json out.json]

CPU only; about a minute per learning rate on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

from refitplane.client import RefitClient
from refitplane.generator.hf_tensor_parallel import tp_boxes
from refitplane.generator.reference_engine import ReferenceEngine, specs_of
from refitplane.protocol import RefitState
from refitplane.reshard.boxes import to_slices
from refitplane.reshard.shards import LocalShards
from refitplane.testing.coordinator import start_coordinator
from refitplane.trainer.agent import TrainerAgent

JOB = "delta-training"
GEN_TP = 2


def _model(seed: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config).float()


def _trainer_shards(published: dict[str, torch.Tensor]) -> LocalShards:
    """Trainer TP1: every published tensor whole (views of the tensors it refits from)."""
    shards = LocalShards()
    for name, spec in specs_of(published).items():
        shards.add(spec, tuple((0, n) for n in spec.shape), published[name])
    return shards


def _check(gens: list[ReferenceEngine], published: dict[str, torch.Tensor]) -> None:
    for g in gens:
        for name, tensor in published.items():
            box = tp_boxes(g.specs[name], g.world_size).get(g.rank)
            if box is not None and not torch.equal(
                g.shards.view(name, box).view(torch.uint8),
                tensor[to_slices(box)].contiguous().view(torch.uint8),
            ):
                raise SystemExit(f"generator rank {g.rank} holds other bytes for {name}")


def _wait_layouts(client: RefitClient, members: int) -> None:
    deadline = time.monotonic() + 30
    while sum(1 for m in client.topology(JOB).members if m.layout_digest) < members:
        if time.monotonic() > deadline:
            raise SystemExit("members did not publish their layouts within 30 s")
        time.sleep(0.05)


def run(lr: float, steps: int, seed: int) -> list[dict[str, Any]]:
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed + 1)
    published = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    specs = specs_of(published)
    coordinator = start_coordinator(
        delta="auto", prepare_timeout_s=60.0, transfer_timeout_s=120.0, group_timeout_s=60.0
    )
    trainer = TrainerAgent(
        coordinator=coordinator.grpc_target,
        job=JOB,
        rank=0,
        world_size=1,
        shards=_trainer_shards(published),
    )
    gens = [
        ReferenceEngine(
            coordinator=coordinator.grpc_target,
            job=JOB,
            replica_id="rep-0",
            rank=r,
            world_size=GEN_TP,
            specs=specs,
        )
        for r in range(GEN_TP)
    ]
    rows = []
    try:
        for agent in (trainer, *gens):
            agent.start()
        with RefitClient(coordinator.grpc_target) as client:
            _wait_layouts(client, 1 + GEN_TP)
            for step in range(steps + 1):
                changed, elements = 0, 0
                loss = float("nan")
                if step:
                    tokens = torch.randint(0, 4096, (4, 128), generator=g)
                    out = model(input_ids=tokens, labels=tokens)
                    out.loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    loss = float(out.loss.detach())
                    with trainer.updating_weights(), torch.no_grad():
                        for name, p in model.named_parameters():
                            new = p.detach().to(torch.bfloat16)
                            changed += int(
                                (new.view(torch.int16) != published[name].view(torch.int16)).sum()
                            )
                            elements += new.numel()
                            published[name].copy_(new)
                refit = client.wait(
                    client.trigger(JOB, idempotency_key=f"{lr}-{step}").refit_id, timeout_s=120
                )
                if refit.state is not RefitState.COMMITTED:
                    raise SystemExit(f"step {step}: refit {refit.state}: {refit.message}")
                _check(gens, published)
                if not step:
                    continue  # the first refit has no base: the full path, by design
                rows.append(
                    {
                        "lr": lr,
                        "step": step,
                        "loss": round(loss, 4),
                        "changed_fraction": changed / elements,
                        "full_bytes": refit.bytes_total,
                        "wire_bytes": refit.bytes_on_wire,
                        "ratio": refit.bytes_on_wire / refit.bytes_total,
                        "path": "delta" if refit.delta_replicas else "full",
                        "refit_ms": 1e3 * sum(t.seconds for t in refit.timings),
                    }
                )
    finally:
        for agent in (trainer, *gens):
            agent.close()
        coordinator.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[1])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    started = time.time()
    results: list[dict[str, Any]] = []
    print(
        f"{'lr':>8} {'step':>4} {'loss':>7} {'changed %':>10} {'wire MiB':>9} "
        f"{'full MiB':>9} {'wire/full':>9} {'path':>6} {'refit ms':>9}"
    )
    for lr in args.lr:
        for row in run(lr, args.steps, args.seed):
            results.append(row)
            print(
                f"{lr:>8.0e} {row['step']:>4} {row['loss']:>7.3f} "
                f"{100 * row['changed_fraction']:>10.3f} {row['wire_bytes'] / 2**20:>9.2f} "
                f"{row['full_bytes'] / 2**20:>9.2f} {row['ratio']:>9.3f} {row['path']:>6} "
                f"{row['refit_ms']:>9.1f}"
            )
    print()
    print(f"{'lr':>8} {'median changed %':>17} {'median wire/full':>17} {'max wire/full':>14}")
    for lr in args.lr:
        rows = [r for r in results if r["lr"] == lr]
        print(
            f"{lr:>8.0e} {100 * statistics.median(r['changed_fraction'] for r in rows):>17.3f} "
            f"{statistics.median(r['ratio'] for r in rows):>17.3f} "
            f"{max(r['ratio'] for r in rows):>14.3f}"
        )
    print(
        f"\n{platform.machine()}, torch {torch.__version__}, every refit byte-exact, "
        f"{time.time() - started:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
