"""Errors the CLI prints on one line with exit code 2 (bad usage or config)."""

from elastic.config import ConfigError


class UsageError(Exception):
    """Bad usage of a command: printed on one line, exit code 2."""


__all__ = ["ConfigError", "UsageError"]
