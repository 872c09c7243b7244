"""`refitctl`: the operator's command line.

Each subcommand lives in its own module under `refitplane.cli` and exposes
`register(subparsers)`; heavy imports happen inside the handlers so `refitctl --help`
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from refitplane.errors import RefitError

# Modules that contribute subcommands, in help order.
SUBCOMMAND_MODULES = (
    "refitplane.cli.plan_cmd",
    "refitplane.cli.refit_cmds",
    "refitplane.cli.demo_cmd",
)

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refitctl", description="Weight-refit control plane: plan, trigger and watch refits."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except RefitError as exc:
        print(f"error ({exc.reason}): {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
