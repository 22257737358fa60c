"""The `elastic` console script.

Each subcommand lives in `elastic/commands/<name>.py` and exposes
`register(subparsers)`, which adds its parser and sets `func(args) -> int`.
Exit codes: 0 success, 1 the job (or check) failed, 2 bad usage or config.
Errors print on one line; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from elastic.errors import ConfigError, UsageError

COMMANDS = ("run", "plan", "ckpt", "report", "config", "data")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic", description="Elastic training on Ray: run, plan, inspect checkpoints, report.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"elastic.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"elastic.commands.{name}":
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ConfigError, UsageError) as exc:
        if args.debug:
            raise
        print(f"elastic: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("elastic: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the user, the traceback with --debug
        if args.debug:
            raise
        print(f"elastic: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
