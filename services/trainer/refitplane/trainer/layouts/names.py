"""Module names → canonical (Hugging Face checkpoint) names for DTensor/FSDP2 models."""

from __future__ import annotations

from collections.abc import Callable, Mapping

# Inserted into parameter names by wrappers that do not change the weight itself:
# torch.compile, FSDP1, activation checkpointing, DDP (`module.` only as a leading prefix).
WRAPPER_PARTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
LEADING_WRAPPERS = ("module.",)

NameMap = Callable[[str], str | None] | Mapping[str, str]


def strip_wrapper_prefixes(name: str) -> str:
    """`_orig_mod.model._fsdp_wrapped_module.layers.0.x` → `model.layers.0.x`."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    changed = True
    while changed:
        changed = False
        for prefix in LEADING_WRAPPERS:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                changed = True
    return name


def canonical_name(name: str, name_map: NameMap | None) -> str | None:
    """The canonical name of a module parameter, or None to leave it out of the refit.

    A mapping renames the names it lists and keeps the others; a callable decides for
    every name (returning None drops it, e.g. for trainer-only parameters).
    """
    clean = strip_wrapper_prefixes(name)
    if name_map is None:
        return clean
    if isinstance(name_map, Mapping):
        return name_map.get(clean, clean)
    return name_map(clean)
