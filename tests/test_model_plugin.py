"""The model plug-in in one process: builders by import path, their checks, seeded and pretrained initial weights, schedules."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from elastic.config import ConfigError, load_config
from elastic.recipe import build_model
from elastic.schedule import lr_at

ROOT = Path(__file__).resolve().parents[1]


def test_strategies_and_storage_import_without_elastic():
    """The libraries a user's model meets never import the job manager: every module of them loads with `elastic` unimportable."""
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys

        class NoElastic:
            def find_spec(self, name, path=None, target=None):
                if name == "elastic" or name.startswith("elastic."):
                    raise ImportError(f"{name} is off limits")

        sys.meta_path.insert(0, NoElastic())
        import storage, strategies
        for pkg in (strategies, storage):
            for info in pkgutil.iter_modules(pkg.__path__):
                importlib.import_module(f"{pkg.__name__}.{info.name}")
        assert not [m for m in sys.modules if m == "elastic" or m.startswith("elastic.")]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
