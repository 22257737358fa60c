"""Resolve a user's `package.module:function` named in the job config.

Ranks receive import paths and JSON, never pickled callables: each process
imports the function itself. The current directory (the job's working
directory, which `ray job submit --working-dir` ships and rank processes
start in) is on the import path, so a module next to the job YAML resolves.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

from elastic.config import ConfigError


def resolve(target: str, field: str) -> Callable:
    """The function `target` ('package.module:function') names; ConfigError naming `field` if it cannot be had."""
    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{field}: cannot import {module_name!r} ({exc}); is it in the job's working directory?") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing: say so on one line
        raise ConfigError(f"{field}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{field}: module {module_name!r} has no function {attr!r}")
    return fn
