"""The `elastic` console script.

Each subcommand lives in `elastic/commands/<name>.py` and exposes
`register(subparsers)`, which adds its parser and sets `func(args) -> int`.
Exit codes: 0 success, 1 the job (or check) failed, 2 bad usage or config,
141 the reader of stdout closed the pipe early (`elastic config schema | head -1`),
as SIGPIPE ends a Unix filter, without a message. Errors print on one line;
`--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import signal
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
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe is found here, not in Python's flush at exit (which prints a traceback)
        return code
    except (ConfigError, UsageError) as exc:
        if args.debug:
            raise
        print(f"elastic: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("elastic: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the user, the traceback with --debug
        if isinstance(exc, BrokenPipeError) and _stdout_closed():  # else a socket or a child's pipe broke: an error
            return _reader_gone()
        if args.debug:
            raise
        print(f"elastic: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone: poll says so (POLLERR) without writing anything."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # replaced by an object without a descriptor (main called with stdout captured)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _reader_gone() -> int:
    """Stop quietly: what is still buffered, and Python's flush at exit, go to /dev/null instead of raising again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
