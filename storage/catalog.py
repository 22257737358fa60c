"""What is under a checkpoint URI: the commit that makes a step a checkpoint, committed checkpoints, their
verification, retention and clean-up. Nothing here imports torch (`storage.format` neither).

A step directory counts as a checkpoint only when its manifest exists and
parses. `verify` walks the whole chain of trust (manifest, index, every data
file and every piece) and raises a `CheckpointError` naming the first file that
fails; `latest_valid` is what a restarting job uses: the newest checkpoint that
verifies, falling back to older ones and saying why.
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from storage.format import (
    FORMAT,
    INDEX,
    MANIFEST,
    VERSION,
    CheckpointError,
    Piece,
    align_up,
    check_coverage,
    crc32,
    data_file_generation,
    decode_index,
    decode_manifest,
    encode_index,
    encode_manifest,
    parse_step_dir,
    step_dir,
)
from storage.fs import Store

_READ_BLOCK = 16 << 20


def commit(
    uri: str,
    step: int,
    rows: list[dict],
    *,
    generation: int,
    layout: dict,
    train_state: dict,
    storage_options: dict | None = None,
    publish_if: Callable[[], bool] | None = None,
) -> dict:
    """Write the index, then the manifest (the commit); returns the manifest.

    `rows` are all ranks' `write_shards` rows of `generation`, the generation
    that commits: a row naming a file of any other generation is refused.
    `publish_if()` is asked right before the manifest is published
    (`Store.write_atomic`): when it says False, the commit stops with a
    CheckpointError and the step stays uncommitted. A caller that abandons a
    commit at its deadline fences it so: should the storage come back, the
    commit still never lands.
    """
    store = Store(uri, storage_options)
    where = store.describe(step_dir(step))
    files: dict[str, dict] = {}
    for row in rows:
        written_by = data_file_generation(row["file"])
        if written_by != generation:
            raise CheckpointError(
                f"{where}: a row names {row['file']!r}, not a file of generation {generation}, which commits "
                "(a late write of another generation?)"
            )
        entry = {"bytes": row["file_bytes"], "crc32": row["file_crc32"]}
        if files.setdefault(row["file"], entry) != entry:
            raise CheckpointError(f"{where}: rows disagree about {row['file']}")
    pieces = [Piece.from_row(r) for r in rows]
    tensors = check_coverage(pieces, where)
    for rel, entry in files.items():
        try:
            size = store.size(f"{step_dir(step)}/{rel}")
        except FileNotFoundError:
            raise CheckpointError(f"{where}/{rel} is missing: a rank did not finish writing") from None
        if size != entry["bytes"]:
            raise CheckpointError(f"{where}/{rel} has {size} bytes, its rank reported {entry['bytes']}")
    index = encode_index(rows)
    store.write(f"{step_dir(step)}/{INDEX}", [index])
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "generation": generation,
        "created_unix": time.time(),
        "layout": dict(layout),
        "train_state": train_state,
        "index": {"file": INDEX, "bytes": len(index), "crc32": crc32(index), "rows": len(rows)},
        "files": dict(sorted(files.items())),
        "bytes": sum(e["bytes"] for e in files.values()),
        "tensors": dict(sorted(tensors.items())),
    }
    if not store.write_atomic(f"{step_dir(step)}/{MANIFEST}", encode_manifest(manifest), publish_if=publish_if):
        raise CheckpointError(f"{where}: the commit was called off before its manifest was published")
    store.sync_dir()  # the step directory's own entry in the root
    return manifest


def read_manifest(uri: str, step: int, *, storage_options: dict | None = None) -> dict:
    """The manifest of a committed checkpoint; CheckpointError if it is missing or garbled."""
    return _manifest(Store(uri, storage_options), step)


def _manifest(store: Store, step: int) -> dict:
    where = store.describe(step_dir(step))
    data = _read(store, f"{step_dir(step)}/{MANIFEST}", f"step {step} is not a committed checkpoint")
    return decode_manifest(data, step, where)


def read_index(store: Store, step: int, manifest: dict) -> list[Piece]:
    """The index of a committed checkpoint, checked against the manifest (size, CRC-32, every row's target)."""
    where = store.describe(step_dir(step))
    data = _read(store, f"{step_dir(step)}/{INDEX}")
    expected = manifest["index"]
    if len(data) != expected["bytes"]:
        raise CheckpointError(f"{where}/{INDEX} has {len(data)} bytes, the manifest says {expected['bytes']} (truncated?)")
    if crc32(data) != expected["crc32"]:
        raise CheckpointError(f"{where}/{INDEX} fails its checksum (corrupted)")
    return decode_index(data, manifest["files"], where)


def _read(store: Store, rel: str, missing: str = "") -> bytes:
    """A whole small file; any I/O error is a CheckpointError naming it (a restart then falls back to an older checkpoint)."""
    try:
        return store.read(rel)
    except FileNotFoundError:
        raise CheckpointError(f"{store.describe(rel)} is missing" + (f": {missing}" if missing else "")) from None
    except OSError as exc:
        raise unreadable(store.describe(rel), exc) from None


def unreadable(name: str, exc: OSError) -> CheckpointError:
    """The CheckpointError for an I/O error (EIO, ESTALE, a directory where a file should be, a symlink, ...)."""
    return CheckpointError(f"{name} cannot be read: {exc.strerror or type(exc).__name__ + ': ' + str(exc)}")


def _steps(store: Store) -> list[int]:
    """Step numbers of every step directory, committed or not, newest first."""
    return sorted((s for s in map(parse_step_dir, store.list_dirs()) if s is not None), reverse=True)


def _committed(store: Store, step: int) -> bool:
    """Whether the step directory has a manifest; when that cannot be told (an I/O error), it is taken to have one,
    so that it is never cleaned as an incomplete save and reading it reports the error."""
    try:
        return store.exists(f"{step_dir(step)}/{MANIFEST}")
    except OSError:
        return True


def list_checkpoints(uri: str, *, storage_options: dict | None = None) -> list[dict]:
    """Committed checkpoints, newest first: step, layout, bytes, files, tensors, created time, train_state.

    A directory whose manifest is garbled is listed with an `error` instead,
    so a broken checkpoint is visible rather than silently missing.
    """
    store = Store(uri, storage_options)
    out = []
    for step in _steps(store):
        if not _committed(store, step):
            continue
        try:
            m = _manifest(store, step)
        except CheckpointError as exc:
            out.append({"step": step, "uri": store.describe(step_dir(step)), "error": str(exc)})
            continue
        out.append(
            {
                "step": step,
                "uri": store.describe(step_dir(step)),
                "layout": m["layout"],
                "bytes": m.get("bytes", sum(f["bytes"] for f in m["files"].values())),
                "files": len(m["files"]),
                "tensors": len(m.get("tensors", {})),
                "created_unix": m.get("created_unix"),
                "train_state": m["train_state"],
            }
        )
    return out


def verify(uri: str, step: int, *, deep: bool = True, storage_options: dict | None = None) -> dict:
    """Check a whole checkpoint: manifest, index, every file's size and CRC-32, every piece's CRC-32.

    With `deep=False` the data is not read: manifest, index and file sizes
    only (each loading rank still checks every piece it reads). Returns the
    manifest; raises CheckpointError naming the file and the problem.
    """
    return _verify(Store(uri, storage_options), step, deep=deep)


def _verify(store: Store, step: int, *, deep: bool) -> dict:
    manifest = _manifest(store, step)
    pieces = read_index(store, step, manifest)
    where = store.describe(step_dir(step))
    check_coverage(pieces, f"{where}/{INDEX}")
    by_file: dict[str, list[Piece]] = {rel: [] for rel in manifest["files"]}
    for p in pieces:
        by_file[p.file].append(p)
    for rel, entry in manifest["files"].items():
        _verify_file(store, f"{step_dir(step)}/{rel}", entry, sorted(by_file[rel], key=lambda p: p.byte_offset), deep)
    return manifest


def _verify_file(store: Store, rel: str, entry: dict, pieces: list[Piece], deep: bool) -> None:
    name = store.describe(rel)
    try:
        size = store.size(rel)
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing") from None
    except OSError as exc:
        raise unreadable(name, exc) from None
    if size < entry["bytes"]:
        raise CheckpointError(f"{name} is truncated: {size} bytes, the manifest says {entry['bytes']}")
    if size > entry["bytes"]:
        raise CheckpointError(f"{name} has {size} bytes, more than the {entry['bytes']} the manifest says")
    pos = 0
    for p in pieces:
        if p.byte_offset != align_up(pos):
            raise CheckpointError(f"{name}: index rows leave a gap or overlap at byte {pos} (row {p.key!r} starts at {p.byte_offset})")
        pos = p.byte_offset + p.nbytes
    if pos != entry["bytes"]:
        raise CheckpointError(f"{name}: index rows cover {pos} of its {entry['bytes']} bytes")
    if not deep:
        return
    try:
        file_crc = _check_pieces(store, rel, name, pieces)
    except OSError as exc:
        raise unreadable(name, exc) from None
    if file_crc != entry["crc32"]:
        raise CheckpointError(f"{name} fails its file checksum (corrupted data)")


def _check_pieces(store: Store, rel: str, name: str, pieces: list[Piece]) -> int:
    """Read a data file once, checking every piece's CRC-32; returns the whole file's."""
    file_crc, pos = 0, 0
    with store.open_read(rel) as f:
        for p in pieces:
            pad = f.read(p.byte_offset - pos)
            file_crc = crc32(pad, file_crc)
            pos = p.byte_offset + p.nbytes
            piece_crc, left = 0, p.nbytes
            while left:
                block = f.read(min(left, _READ_BLOCK))
                if not block:
                    raise CheckpointError(f"{name} is truncated: it ends inside piece {p.key!r} at byte {p.byte_offset}")
                piece_crc, file_crc = crc32(block, piece_crc), crc32(block, file_crc)
                left -= len(block)
            if piece_crc != p.crc32:
                raise CheckpointError(
                    f"{name}: piece {p.key!r} at {list(p.offsets)} (bytes {p.byte_offset}..{p.byte_offset + p.nbytes}) "
                    "fails its checksum (corrupted data)"
                )
    return file_crc


def latest_valid(
    uri: str, *, on_skip: Callable[[int, str], None] | None = None, deep: bool = True, storage_options: dict | None = None
) -> int | None:
    """The newest committed step that verifies, or None; `on_skip(step, reason)` hears of every newer one that did not.

    `deep=False` skips reading the data (see `verify`): for checkpoints too
    large for one process to read at every restart.
    """
    store = Store(uri, storage_options)
    for step in _steps(store):
        if not _committed(store, step):
            continue
        try:
            _verify(store, step, deep=deep)
        except CheckpointError as exc:
            if on_skip is not None:
                on_skip(step, str(exc))
            continue
        return step
    return None


def clean_incomplete(uri: str, *, storage_options: dict | None = None) -> list[int]:
    """Delete every step directory without a manifest; returns their steps.

    Call it only when no save can be in flight (at job start); during a run,
    `retain` cleans what is safe to clean.
    """
    store = Store(uri, storage_options)
    removed = []
    for step in _steps(store):
        if not _committed(store, step):
            store.remove_tree(step_dir(step))
            removed.append(step)
    return removed


def retain(uri: str, keep: int, *, in_progress: Iterable[int] = (), storage_options: dict | None = None) -> list[int]:
    """Keep the newest `keep` checkpoints that verify; delete what is older than the newest of them. Returns the deleted steps.

    Only checkpoints that pass a shallow `verify` (manifest, index, file
    sizes) count toward `keep`, so the newest checkpoint that verifies is never
    deleted, whatever garbled or half-written directories sit above it. Shallow
    is enough here: retention runs after each commit, and reading every byte of
    every kept checkpoint each time would cost a full read per save; what it
    cannot see (a bit flipped on disk after the commit) is what keeping more
    than one checkpoint, and the deep check of `latest_valid` on restart, are for.

    Nothing newer than the newest valid checkpoint is deleted: a broken
    checkpoint there stays for inspection (it never counts toward `keep`), an
    incomplete directory may be a save still being written. Below it, valid
    checkpoints beyond `keep`, broken ones and incomplete directories are
    deleted, except the steps named in `in_progress` (saves of this job still
    being written). With no valid checkpoint nothing is deleted. The manifest
    goes first, so a deletion cut short leaves an incomplete directory (cleaned
    next time), never a committed checkpoint with missing files.
    """
    if keep < 1:
        raise ValueError("retain: keep must be at least 1")
    store = Store(uri, storage_options)
    steps = _steps(store)  # newest first
    valid: list[int] = []
    for step in steps:
        if len(valid) == keep:
            break
        if _verifies(store, step):
            valid.append(step)
    if not valid:
        return []
    spared = set(valid) | set(in_progress)
    doomed = [step for step in steps if step < valid[0] and step not in spared]
    for step in doomed:
        _remove_step(store, step)
    return doomed


def _verifies(store: Store, step: int) -> bool:
    try:
        _verify(store, step, deep=False)
    except CheckpointError:
        return False
    return True


def _remove_step(store: Store, step: int) -> None:
    store.remove(f"{step_dir(step)}/{MANIFEST}")
    store.remove_tree(step_dir(step))


def remove_all(uri: str, *, storage_options: dict | None = None) -> list[int]:
    """Delete every checkpoint directory under `uri`, committed or not (a fresh start); other files stay."""
    store = Store(uri, storage_options)
    steps = _steps(store)
    for step in steps:
        _remove_step(store, step)
    return steps


def corrupt_newest(uri: str, *, seed: int = 0, storage_options: dict | None = None) -> str | None:
    """Fault injection: flip one bit of a data file of the newest committed checkpoint whose manifest reads, chosen by `seed`.

    Returns the corrupted file and byte (`URI@BYTE`), or None when there is no
    checkpoint. `verify` and `latest_valid` must then reject that checkpoint.
    """
    store = Store(uri, storage_options)
    for step in _steps(store):
        try:
            manifest = _manifest(store, step)
        except CheckpointError:
            continue  # not committed, or broken already
        files = sorted((rel, e["bytes"]) for rel, e in manifest["files"].items() if e["bytes"])
        if not files:
            return None
        rng = random.Random(seed)
        rel, size = files[rng.randrange(len(files))]
        at = rng.randrange(size)
        path = f"{step_dir(step)}/{rel}"
        data = bytearray(_read(store, path))  # never through a link: only this checkpoint's own file
        data[at] ^= 1 << rng.randrange(8)
        store.write(path, [data])
        return f"{store.describe(path)}@{at}"
    return None


def check_writable(uri: str, *, storage_options: dict | None = None, what: str = "checkpoint URI") -> None:
    """Fail early, with one message naming `what` and `uri`, when checkpoints cannot be written under `uri`.

    The probe leaves nothing behind: its file is removed, and so are the
    local directories it had to create, so a check that does not run the job
    (`elastic config validate`) changes nothing there; a job creates them
    again when it takes its lease. (On S3 a missing bucket is created, and stays.)
    """
    try:
        store = Store(uri, storage_options)
        created = _missing_dirs(store.local) if store.local is not None else []
        try:
            store.makedirs()
            probe = f".write-probe-{uuid.uuid4().hex}"
            store.write(probe, [b"ok"])
            ok = store.read(probe) == b"ok"
            store.remove(probe)
        finally:
            for directory in created:
                with contextlib.suppress(OSError):  # something else was put there meanwhile: it stays
                    directory.rmdir()
    except Exception as exc:  # noqa: BLE001 - any failure here means the same thing to the user
        raise CheckpointError(f"{what} {uri} is not writable: {type(exc).__name__}: {exc}") from None
    if not ok:
        raise CheckpointError(f"{what} {uri} is not writable: a probe file did not read back")


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing
