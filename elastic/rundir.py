"""The run directory (`run_root/name`): elastic writes only into, and deletes only, directories it created.

When elastic creates a run directory it writes a marker file (`MARKER`) into
it. `--fresh` deletes a run directory only when it carries the marker, or
when it is a run directory of a version before the marker: every entry in it
is one elastic writes there (`LEGACY_ENTRIES`: events.jsonl, report.json, the
default checkpoints/ directory, the report's plots), and a checkpoints/ there
holds nothing but checkpoint directories, one of them committed (`step_*`
with its manifest.json), so `make demo --fresh` still works on an old
runs/demo while someone's own `checkpoints/` is never taken for elastic's. A
run directory that exists, is not empty
and is neither is refused (exit 2), with or without `--fresh`: elastic would
write its logs and checkpoints among someone else's files. So are a
`run_root` that is `/` or the home directory, and a run directory that is `/`,
the home directory or holds the current directory.

One invocation of a job (`open_run`) holds a lease on its run directory and
one on its checkpoint URI (`storage.Lease`) while it runs, so a second job
pointed at either is refused instead of overwriting the first one's files.
It has one event log and one report: those of an earlier invocation move to
`attempts/N/` (`elastic report` shows every attempt). An earlier run's
checkpoints are never mixed with a new run's: with `checkpoint.resume: false`
an occupied checkpoint URI is refused (`--fresh` deletes it), and a run whose
final checkpoint exists is not run again without `--fresh`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from elastic.config import ConfigError
from storage.format import MANIFEST, parse_step_dir
from storage.lease import LEASE_FILE, Lease, LeaseHeld

MARKER = ".elastic-run"
"""The file that says elastic created this directory (and may delete it with --fresh)."""
LEGACY_ENTRIES = frozenset({"events.jsonl", "report.json", "checkpoints", "loss.png", "world_size.png", "time_breakdown.png", LEASE_FILE})
"""What a run directory written before the marker existed holds; one with only these is taken as elastic's."""


def _is_ours(run_dir: Path) -> bool:
    entries = {p.name for p in run_dir.iterdir()}
    if MARKER in entries:
        return True
    legacy = bool(entries) and entries <= LEGACY_ENTRIES
    return legacy and ("checkpoints" not in entries or _legacy_checkpoints(run_dir / "checkpoints"))


def _legacy_checkpoints(path: Path) -> bool:
    """Whether `checkpoints/` is recognisably elastic's: only step directories (and a lease), at least one with its manifest."""
    if path.is_symlink() or not path.is_dir():
        return False
    others = [p for p in path.iterdir() if p.name != LEASE_FILE]
    steps = [p for p in others if parse_step_dir(p.name) is not None and p.is_dir() and not p.is_symlink()]
    return len(steps) == len(others) and any((p / MANIFEST).is_file() for p in steps)


def _refuse_special(field: str, path: Path) -> None:
    """`/`, the home directory, and any directory that holds the current one are never a run root or run directory."""
    home, cwd = Path.home().resolve(), Path.cwd().resolve()
    if path == Path(path.anchor) or path == home:
        raise ConfigError(f"{field} {str(path)!r} is {'the filesystem root' if path == Path(path.anchor) else 'the home directory'}: "
                          "choose a directory for elastic's runs (the default is runs/)")
    if field == "run directory" and (path == cwd or path in cwd.parents):
        raise ConfigError(f"run directory {str(path)!r} (run_root/name) holds the current directory: choose another run_root or name")


def _checked(run_root: str, name: str) -> Path:
    """The run directory `run_root/name`, or a ConfigError where elastic must not write into it (nothing is changed)."""
    root = Path(run_root).resolve()
    run_dir = root / name
    _refuse_special("run_root", root)
    _refuse_special("run directory", run_dir)
    if run_dir.is_symlink() or (run_dir.exists() and not run_dir.is_dir()):
        raise ConfigError(f"run directory {str(run_dir)!r} (run_root/name) is not a directory elastic created: choose another run_root or name")
    if run_dir.exists() and any(run_dir.iterdir()) and not _is_ours(run_dir):
        raise ConfigError(
            f"run directory {str(run_dir)!r} (run_root/name) is not empty and was not created by elastic (no {MARKER} file): "
            "choose another run_root or name; --fresh deletes only run directories elastic created"
        )
    return run_dir


def _empty(run_dir: Path, keep: frozenset[str] = frozenset()) -> None:
    for entry in run_dir.iterdir():
        if entry.name in keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def claim(run_root: str, name: str, *, fresh: bool, before_delete: Callable[[Path], None] | None = None) -> Path:
    """Create (or, with `fresh`, empty) the run directory `run_root/name` and return it; ConfigError where it is not elastic's.

    `before_delete(run_dir)` runs once the directory exists and before
    anything in it is deleted (the caller takes its lease there); the lease
    file itself survives `fresh`.
    """
    run_dir = _checked(run_root, name)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if before_delete is not None:
            before_delete(run_dir)
        if fresh:
            _empty(run_dir, keep=frozenset({LEASE_FILE}))
        (run_dir / MARKER).write_text("created by elastic: `elastic run --fresh` may delete this directory\n")
    except OSError as exc:
        raise ConfigError(f"run_root: cannot use the run directory {str(run_dir)!r}: {exc.strerror or exc}") from None
    return run_dir


# -- one invocation of a job ------------------------------------------------------------------------------------
ATTEMPT_FILES = ("events.jsonl", "report.json", "loss.png", "world_size.png", "time_breakdown.png")
"""What one invocation writes at the top of its run directory; an earlier invocation's are moved to `attempts/N/`."""


@dataclass
class RunClaim:
    """What one invocation of a job holds while it runs: its run directory, its attempt number and its leases."""

    run_dir: Path
    attempt: int
    leases: list[Lease] = field(default_factory=list)

    def start_renewing(self, on_lost: Callable[[str], None]) -> None:
        """Renew every lease in the background; `on_lost(reason)` if one is lost (another job took it over)."""
        for lease in self.leases:
            lease.start_renewing(on_lost=lambda exc, where=lease.where: on_lost(f"lost the lease {where}: {exc}"))

    def release(self) -> None:
        for lease in reversed(self.leases):
            lease.stop()
            lease.release()
        self.leases = []


def _take(uri: str, owner: dict, field_name: str, storage_options: dict | None = None) -> Lease:
    lease = Lease(uri, owner, storage_options=storage_options)
    try:
        lease.acquire()
    except LeaseHeld as exc:
        raise ConfigError(f"{field_name}: {exc}; another job is using it: wait for it to end, or choose another one") from None
    return lease


def attempts(run_dir: Path) -> list[Path]:
    """The directories of a run's earlier invocations, oldest first (`attempts/1`, `attempts/2`, ...)."""
    root = run_dir / "attempts"
    found = [p for p in root.iterdir() if p.is_dir() and p.name.isdigit()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name))


def _archive_previous(run_dir: Path) -> int:
    """Move the previous invocation's files to `attempts/N/`; returns this invocation's attempt number."""
    done = attempts(run_dir)
    number = int(done[-1].name) + 1 if done else 1
    present = [name for name in ATTEMPT_FILES if (run_dir / name).exists()]
    if not present:
        return number
    target = run_dir / "attempts" / str(number)
    target.mkdir(parents=True)
    for name in present:
        (run_dir / name).rename(target / name)
    return number + 1


def _refuse_reuse(cfg, newest: int | None) -> None:
    """What an earlier run under the same name and checkpoint URI forbids, as one-line ConfigErrors."""
    if newest is None:
        return
    where = f"checkpoint.uri {cfg.checkpoint.uri!r}"
    if not cfg.checkpoint.resume:
        raise ConfigError(f"{where} holds checkpoints of an earlier run (newest step {newest}) and checkpoint.resume is false: "
                          "pass --fresh to delete them, or set another checkpoint.uri")
    if newest >= cfg.training.steps:
        raise ConfigError(f"{where} holds the final checkpoint of a finished run (step {newest} of training.steps={cfg.training.steps}): "
                          "pass --fresh to run it again, or raise training.steps to train on")


def open_run(cfg, *, fresh: bool) -> RunClaim:
    """Claim the run directory and the checkpoint URI for one invocation of `cfg` (checkpoint.uri already absolute).

    In order: the run directory is checked (`claim`); leases are taken on it
    and on the checkpoint URI, so a second job on either is refused before
    anything is deleted; `fresh` deletes the run's files and checkpoints; an
    earlier run's checkpoints are refused where they would be mixed with this
    one's (`checkpoint.resume: false`) or where there is nothing left to do;
    the earlier invocation's log and report move to `attempts/N/`.
    """
    import storage

    owner = {"job": cfg.name, "started_unix": round(time.time(), 3)}
    leases: list[Lease] = []
    try:
        run_dir = claim(cfg.run_root, cfg.name, fresh=fresh, before_delete=lambda d: leases.append(_take(str(d), owner, "run directory")))
        leases.append(_take(cfg.checkpoint.uri, owner, "checkpoint.uri"))
        if fresh:
            storage.remove_all(cfg.checkpoint.uri)
        committed = [c["step"] for c in storage.list_checkpoints(cfg.checkpoint.uri) if "error" not in c]
        _refuse_reuse(cfg, max(committed) if committed else None)
        attempt = _archive_previous(run_dir)
    except BaseException:
        for lease in reversed(leases):
            lease.release()
        raise
    return RunClaim(run_dir, attempt, leases)
