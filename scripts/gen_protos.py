#!/usr/bin/env python3
"""Generate the Python stubs (+ .pyi) for proto/refit/v1 into refitplane/_generated.

    python scripts/gen_protos.py          # regenerate
    python scripts/gen_protos.py --check  # exit 1 if the checked-in stubs are stale

Generated modules import each other as `refitplane._generated.refit.v1.*` (rewritten from
protoc's top-level `refit.v1`), so the stubs live inside the package.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "refitplane" / "_generated"
PACKAGE = "refitplane._generated"
_IMPORT = re.compile(r"^from refit\.v1 import ", re.MULTILINE)
_IMPORT_DOTTED = re.compile(r"^import refit\.v1\.(\w+)", re.MULTILINE)
_NAME = re.compile(r"(?<![\w.])refit\.v1\.(\w+_pb2)")


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *protos,
    ]
    subprocess.run(cmd, check=True, cwd=PROTO_ROOT)
    for path in sorted(out.rglob("*.py*")):
        text = path.read_text()
        text = _IMPORT.sub(f"from {PACKAGE}.refit.v1 import ", text)
        text = _IMPORT_DOTTED.sub(rf"import {PACKAGE}.refit.v1.\1", text)
        text = _NAME.sub(rf"{PACKAGE}.refit.v1.\1", text)
        path.write_text(text)
    for pkg in [out, *[p for p in out.rglob("*") if p.is_dir()]]:
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text("")


def _differences(a: Path, b: Path) -> list[str]:
    names = {p.relative_to(a) for p in a.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    names |= {
        p.relative_to(b) for p in b.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    out = []
    for name in sorted(names):
        pa, pb = a / name, b / name
        if not pa.exists() or not pb.exists() or not filecmp.cmp(pa, pb, shallow=False):
            out.append(str(name))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args()
    if not args.check:
        if OUT.exists():
            shutil.rmtree(OUT)
        generate(OUT)
        print(f"generated stubs in {OUT.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "_generated"
        generate(fresh)
        stale = _differences(fresh, OUT)
    if stale:
        print("stale generated stubs (run scripts/gen_protos.py):", *stale, sep="\n  ")
        return 1
    print("generated stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
