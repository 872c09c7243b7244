"""Where an executor's host time goes, written where REFIT_PROFILE_DIR says (off by default).

Every transfer appends its `TransferReport` (host time by phase) as one JSON line to
`executor-<pid>.jsonl`. With REFIT_PROFILE_CPROFILE=N as well, the N-th transfer of each
process (0-based; pick one that is not timed, e.g. the one after a configuration change)
runs under cProfile: `cprofile-<pid>-<N>.txt` lists its 60 costliest functions by own time,
`.pstats` holds the whole profile. Python's profiler slows that one transfer several times.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import io
import json
import os
import pstats
from collections.abc import Iterator
from typing import Any

PROFILE_DIR = os.environ.get("REFIT_PROFILE_DIR", "")
_CPROFILE_AT = int(os.environ.get("REFIT_PROFILE_CPROFILE", "-1") or -1)
_transfers = 0


def write_report(rank: int, report: Any) -> None:
    """Append one transfer's report (a dataclass) to this process's JSON lines."""
    if not PROFILE_DIR:
        return
    path = os.path.join(PROFILE_DIR, f"executor-{os.getpid()}.jsonl")
    with contextlib.suppress(OSError), open(path, "a") as f:
        f.write(json.dumps({"rank": rank, **dataclasses.asdict(report)}) + "\n")


@contextlib.contextmanager
def transfer_profile(rank: int) -> Iterator[None]:
    """Around one transfer: under cProfile if it is the one REFIT_PROFILE_CPROFILE names."""
    global _transfers
    index, _transfers = _transfers, _transfers + 1
    if not PROFILE_DIR or index != _CPROFILE_AT:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        stem = os.path.join(PROFILE_DIR, f"cprofile-{os.getpid()}-{index}")
        text = io.StringIO()
        text.write(f"rank {rank}, transfer {index} of process {os.getpid()}\n")
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(60)
        with contextlib.suppress(OSError):
            profiler.dump_stats(f"{stem}.pstats")
            with open(f"{stem}.txt", "w") as f:
                f.write(text.getvalue())
