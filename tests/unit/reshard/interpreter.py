"""Running Triton kernels' checks on CPU: in Triton's interpreter, which must be chosen before
Triton is imported, so in a child process."""

from __future__ import annotations

import os
import subprocess
import sys


def run_in_interpreter(module: str, check: str) -> None:
    """Call `module.check("cpu")` in a child process with TRITON_INTERPRET=1; its stderr on
    failure."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"from {module} import {check}; {check}('cpu')"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
