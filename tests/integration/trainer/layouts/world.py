"""A real multi-process Gloo world for layout tests: worker scripts in fresh interpreters.

The parent hosts the rendezvous store on an OS-chosen port and starts one interpreter per
rank running a worker *script* (so the child imports `refitplane` from the installed
package, not from the test tree). Each worker writes its results to files; the parent
kills every rank if one fails or the deadline passes, and reports the ranks' stderr.

The same file is imported by the workers (as a top-level module) for `init_from_env`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ENV_RANK = "LAYOUT_TEST_RANK"
ENV_WORLD = "LAYOUT_TEST_WORLD"
ENV_PORT = "LAYOUT_TEST_STORE_PORT"


def run_world(
    script: Path, world: int, out_dir: Path, *args: str, timeout_s: float = 150.0
) -> None:
    """Run `script` as ranks 0..world-1 of one Gloo world; raise with the logs if any fails."""
    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1",
        0,
        world + 1,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    logs = [out_dir / f"rank{r}.log" for r in range(world)]
    try:
        for rank in range(world):
            env = {
                **os.environ,
                ENV_RANK: str(rank),
                ENV_WORLD: str(world),
                ENV_PORT: str(store.port),
                "OMP_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore",
            }
            with logs[rank].open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(script), str(out_dir), *args],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        del store
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "\n".join(
            f"--- rank {r} (exit {procs[r].returncode}) ---\n"
            + logs[r].read_text(errors="replace")[-4000:]
            for r in failed
        )
        raise AssertionError(f"ranks {failed} failed or timed out after {timeout_s}s:\n{tails}")


def init_from_env() -> tuple[int, int]:
    """In a worker: join the parent's store and the default Gloo group; returns (rank, world)."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    rank, world = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD])
    store = TCPStore(
        "127.0.0.1",
        int(os.environ[ENV_PORT]),
        world + 1,
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    return rank, world
