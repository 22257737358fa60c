"""The run directory (`run_root/name`): elastic writes only into, and deletes only, directories it created.

When elastic creates a run directory it writes a marker file (`MARKER`) into
it. `--fresh` deletes a run directory only when it carries the marker, or
when it is a run directory of a version before the marker: every entry in it
is one elastic writes there (`LEGACY_ENTRIES`: events.jsonl, report.json, the
default checkpoints/ directory, the report's plots), so `make demo --fresh`
still works on an old runs/demo. A run directory that exists, is not empty
and is neither is refused (exit 2), with or without `--fresh`: elastic would
write its logs and checkpoints among someone else's files. So are a
`run_root` that is `/` or the home directory, and a run directory that is `/`,
the home directory or holds the current directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from elastic.config import ConfigError

MARKER = ".elastic-run"
"""The file that says elastic created this directory (and may delete it with --fresh)."""
LEGACY_ENTRIES = frozenset({"events.jsonl", "report.json", "checkpoints", "loss.png", "world_size.png", "time_breakdown.png"})
"""What a run directory written before the marker existed holds; one with only these is taken as elastic's."""


def _is_ours(run_dir: Path) -> bool:
    entries = {p.name for p in run_dir.iterdir()}
    return MARKER in entries or (bool(entries) and entries <= LEGACY_ENTRIES)


def _refuse_special(field: str, path: Path) -> None:
    """`/`, the home directory, and any directory that holds the current one are never a run root or run directory."""
    home, cwd = Path.home().resolve(), Path.cwd().resolve()
    if path == Path(path.anchor) or path == home:
        raise ConfigError(f"{field} {str(path)!r} is {'the filesystem root' if path == Path(path.anchor) else 'the home directory'}: "
                          "choose a directory for elastic's runs (the default is runs/)")
    if field == "run directory" and (path == cwd or path in cwd.parents):
        raise ConfigError(f"run directory {str(path)!r} (run_root/name) holds the current directory: choose another run_root or name")


def claim(run_root: str, name: str, *, fresh: bool) -> Path:
    """Create (or, with `fresh`, recreate) the run directory `run_root/name` and return it; ConfigError where it is not elastic's."""
    root = Path(run_root).resolve()
    run_dir = root / name
    _refuse_special("run_root", root)
    _refuse_special("run directory", run_dir)
    try:
        if run_dir.is_symlink() or (run_dir.exists() and not run_dir.is_dir()):
            raise ConfigError(f"run directory {str(run_dir)!r} (run_root/name) is not a directory elastic created: choose another run_root or name")
        if run_dir.exists() and any(run_dir.iterdir()) and not _is_ours(run_dir):
            raise ConfigError(
                f"run directory {str(run_dir)!r} (run_root/name) is not empty and was not created by elastic (no {MARKER} file): "
                "choose another run_root or name" + ("; --fresh deletes only run directories elastic created" if fresh else "")
            )
        if fresh and run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / MARKER).write_text("created by elastic: `elastic run --fresh` may delete this directory\n")
    except OSError as exc:
        raise ConfigError(f"run_root: cannot use the run directory {str(run_dir)!r}: {exc.strerror or exc}") from None
    return run_dir
