"""`refitctl`: the operator's command line.

Each subcommand lives in its own module under `refitplane.cli` and exposes
`register(subparsers)`; heavy imports happen inside the handlers so `refitctl --help`
stays fast. Failures go to stderr as one line (JSON with `--json`) and exit with a status
by class (`refitplane.cli.exits`); SIGTERM stops a command like ^C.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from refitplane.cli.exits import EXIT_INTERRUPTED, UsageError, report
from refitplane.errors import RefitError
from refitplane.lifecycle import sigterm_as_keyboard_interrupt
from refitplane.version import __version__

# Modules that contribute subcommands, in help order.
SUBCOMMAND_MODULES = (
    "refitplane.cli.plan_cmd",
    "refitplane.cli.refit_cmds",
    "refitplane.cli.demo_cmd",
)

Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """Usage errors become UsageError (reported like every other failure, JSON included)
    instead of argparse's own exit 2; subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="refitctl", description="Weight-refit control plane: plan, trigger and watch refits."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
    args_in = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args_in
    # SIGTERM like ^C: the demo's `finally` stops its child processes, a watch ends.
    try:
        with sigterm_as_keyboard_interrupt():
            args = build_parser().parse_args(args_in)
            handler: Handler = args.handler
            return handler(args)
    except RefitError as exc:
        return report(exc, as_json=as_json)
    except KeyboardInterrupt as exc:
        print(f"refitctl: interrupted ({exc.args[0] if exc.args else 'SIGINT'})", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
