"""Fused runs: canonical tensors that inference engines keep side by side in one parameter.

vLLM (and most engines) fuse a MoE layer's experts into `w13` [E, 2I, H] (expert e's gate
projection, then its up projection) and `w2` [E, H, I], a dense layer's q/k/v into
`qkv_proj` and gate/up into `gate_up_proj`. The checkpoint names them one by one. If the
schedule moves such tensors in the fused memory order and never mixes a run with anything
else in one packed message, a receiver holding the run fused gets every such message as
one contiguous span of its memory: NCCL writes it in place, with no staging and no
unpacking (`message_io.py` finds the spans; it never assumes one).

The order comes from the canonical name alone, so both ends of a link agree on it without
asking each other: `run_of(name)` is the tensor's run (a key, equal for the members of one
run) and its position in the run. A name that matches no rule is in no run.
"""

from __future__ import annotations

import re
from functools import lru_cache

# Names of one run compare equal; () stands for "no run".
RunKey = tuple[str, ...]

_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<suffix>.+)$"
)
# Position of an expert projection in its fused parameter: (run, slot within the expert).
_EXPERT_SLOT = {
    "gate_proj": ("w13", 0),
    "w1": ("w13", 0),
    "up_proj": ("w13", 1),
    "w3": ("w13", 1),
    "down_proj": ("w2", 0),
    "w2": ("w2", 0),
}
_DENSE = re.compile(
    r"^(?P<prefix>.*)\.(?P<proj>q_proj|k_proj|v_proj|gate_proj|up_proj)\.(?P<suffix>.+)$"
)
_DENSE_SLOT = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
}


@lru_cache(maxsize=1 << 17)
def run_of(tensor: str) -> tuple[RunKey, tuple[int, int]] | None:
    """(run key, position) of canonical tensor `tensor`, or None when it is in no run.
    Positions sort in the fused parameter's memory order: (expert, slot) for experts,
    (0, slot) for dense projections. The key keeps the suffix (`weight`, `weight_scale_inv`,
    ...): each is a parameter of its own."""
    match = _EXPERT.match(tensor)
    if match is not None:
        fused, slot = _EXPERT_SLOT[match["proj"]]
        return (match["prefix"], fused, match["suffix"]), (int(match["expert"]), slot)
    match = _DENSE.match(tensor)
    if match is not None:
        fused, slot = _DENSE_SLOT[match["proj"]]
        return (match["prefix"], fused, match["suffix"]), (0, slot)
    return None


def run_key(tensor: str) -> RunKey:
    """The run of `tensor`, () for none."""
    run = run_of(tensor)
    return () if run is None else run[0]
