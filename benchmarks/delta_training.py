#!/usr/bin/env python3
"""How much of a refit changes between RL steps: a real training loop, measured.

A small Qwen3 (transformers, random init at the config's `initializer_range`) trains with
AdamW on random token batches, fp32 master weights; after every step the weights a trainer
would publish are the master weights cast to bf16. For each step and learning rate this
prints the fraction of bf16 elements that differ from the previous step's, and the bytes
a delta refit puts on the wire against a full refit: every message of the TP1 → TP1
schedule (the executor's own buckets, `TransferConfig` defaults) encoded with the encoding
`refitplane.reshard.delta.choose_encoding` picks for it, plus one 16-byte header per
message.

    python benchmarks/delta_training.py [--steps 20] [--lr 1e-6 1e-5] [--json out.json]

CPU only; a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from refitplane.reshard.config import TransferConfig
from refitplane.reshard.delta import changed_words, choose_encoding, word_size
from refitplane.reshard.layout import LayoutBuilder, TensorSpec
from refitplane.reshard.planner import build_plan
from refitplane.reshard.schedule import Message, rank_schedule
from refitplane.reshard.shards import dtype_name

HEADER_BYTES = 16  # per message: encoding and changed-word count, two int64


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


def _messages(published: Mapping[str, torch.Tensor]) -> list[Message]:
    """The TP1 → TP1 schedule's messages for these tensors (sender rank 0 → rank 1)."""
    source, target = LayoutBuilder(), LayoutBuilder()
    for name, tensor in published.items():
        spec = TensorSpec.create(name, tuple(tensor.shape), dtype_name(tensor.dtype))
        full = tuple((0, n) for n in tensor.shape)
        source.add(spec, 0, full)
        target.add(spec, 1, full)
    plan = build_plan(source.build(), target.build())
    return list(rank_schedule(plan.rank_plan(0), TransferConfig()).messages)


def _image(message: Message, published: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A message's bytes as the sender packs them (alignment gaps zero)."""
    image = torch.zeros(message.nbytes, dtype=torch.uint8)
    for chunk in message.chunks:
        rows = published[chunk.tensor][chunk.box[0][0] : chunk.box[0][1]]
        image[chunk.offset : chunk.offset + chunk.nbytes] = (
            rows.contiguous().view(-1).view(torch.uint8)
        )
    return image


def _wire_bytes(
    messages: list[Message],
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
) -> tuple[int, int, dict[str, int]]:
    """(delta bytes on the wire, changed elements, messages per encoding)."""
    wire, changed, encodings = 0, 0, {}
    for m in messages:
        word = word_size(after[c.tensor].element_size() for c in m.chunks)
        old, new = _image(m, before), _image(m, after)
        n = int(changed_words(new, old, word))
        header = choose_encoding(m.nbytes, n, word)
        wire += header.nbytes + HEADER_BYTES
        changed += n
        encodings[header.encoding.name] = encodings.get(header.encoding.name, 0) + 1
    return wire, changed, encodings


def run(lr: float, steps: int, seed: int) -> list[dict[str, Any]]:
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed + 1)

    def publish() -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}

    previous = publish()
    messages = _messages(previous)
    full = sum(m.nbytes for m in messages)
    elements = sum(t.numel() for t in previous.values())
    rows = []
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 4096, (4, 128), generator=g)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        current = publish()
        wire, changed, encodings = _wire_bytes(messages, previous, current)
        rows.append(
            {
                "lr": lr,
                "step": step,
                "loss": round(float(loss.detach()), 4),
                "changed_fraction": changed / elements,
                "full_bytes": full,
                "delta_bytes": wire,
                "ratio": wire / full,
                "messages": len(messages),
                "encodings": encodings,
            }
        )
        previous = current
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    started = time.time()
    results: list[dict[str, Any]] = []
    print(
        f"{'lr':>8} {'step':>4} {'loss':>7} {'changed %':>10} {'delta MiB':>10} "
        f"{'full MiB':>9} {'wire/full':>9}  encodings"
    )
    for lr in args.lr:
        for row in run(lr, args.steps, args.seed):
            results.append(row)
            print(
                f"{lr:>8.0e} {row['step']:>4} {row['loss']:>7.3f} "
                f"{100 * row['changed_fraction']:>10.3f} {row['delta_bytes'] / 2**20:>10.2f} "
                f"{row['full_bytes'] / 2**20:>9.2f} {row['ratio']:>9.3f}  {row['encodings']}"
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
        f"\n{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{time.time() - started:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
