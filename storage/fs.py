"""Where checkpoint bytes live: one root URI, relative paths below it.

Plain paths and `file://` go straight to the OS. Files are written with
`O_DIRECT` where the filesystem allows it: the buffers are copied into reused,
page-aligned staging buffers while a writer thread `pwrite`s the previous
one -- no page-cache copy, no pile of dirty pages left for `fsync` to flush.
(Where direct I/O is refused, e.g. tmpfs, the same pipeline writes through
the page cache.) Every file is `fsync`ed before a save reports
done, and its directory too. Range reads `preadv` straight into the
destination buffers; the manifest (the commit) is published by an atomic rename. Everything else
(`memory://`, `s3://`, any fsspec protocol) goes through fsspec, whose
`cat_ranges` fetches many byte ranges concurrently on object stores and whose
single PUT of a small object is atomic there.
"""

from __future__ import annotations

import mmap
import os
import shutil
import threading
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import fsspec

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)
STAGE_BYTES = 8 << 20
"""Size of one staging buffer of a data-file write (a multiple of the page size)."""
STAGES = 3
"""Staging buffers per write: one being filled, up to two being written."""
_DIRECT_ALIGN = 4096


class Store:
    """Byte-level access to the files under one checkpoint root."""

    def __init__(self, uri: str, storage_options: dict | None = None):
        self.uri = uri.rstrip("/") or "/"
        if "://" not in uri or uri.startswith("file://"):
            self.local: Path | None = Path(uri.removeprefix("file://")).expanduser()
            self.fs = None
            self.root = str(self.local)
        else:
            self.local = None
            self.fs, self.root = fsspec.core.url_to_fs(self.uri, **(storage_options or {}))
            self.root = self.root.rstrip("/")

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def describe(self, rel: str) -> str:
        """The file's URI, for error messages."""
        return f"{self.uri}/{rel}" if rel else self.uri

    # -- writing -------------------------------------------------------------
    def write(self, rel: str, buffers: Iterable, *, durable: bool = True) -> None:
        """Write a file from a sequence of byte buffers; with `durable`, it is on stable storage on return."""
        if self.local is not None:
            target = self.local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_local(target, buffers, durable)
            if durable:
                _fsync_dir(target.parent)
            return
        self.fs.makedirs(self.path(rel).rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(self.path(rel), "wb") as f:
            for buf in buffers:
                f.write(memoryview(buf).cast("B"))

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Publish a small file all at once: readers see the old state or the whole new file, never a part."""
        if self.local is not None:
            target = self.local / rel
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
            self.write(str(tmp.relative_to(self.local)), [data])
            os.replace(tmp, target)
            _fsync_dir(target.parent)
            return
        self.fs.pipe_file(self.path(rel), data)

    # -- reading -------------------------------------------------------------
    def read(self, rel: str) -> bytes:
        if self.local is not None:
            return (self.local / rel).read_bytes()
        return self.fs.cat_file(self.path(rel))

    def read_into(self, rel: str, requests: list[tuple[int, list]]) -> list[int]:
        """Scatter reads: for each (start, buffers), fill the writable buffers back to back from byte `start`.

        Returns the bytes read per request (fewer where the file ends early).
        Local files take one `preadv` per request, straight into the buffers.
        """
        if self.local is not None:
            fd = os.open(self.local / rel, os.O_RDONLY)
            try:
                return [_preadv(fd, buffers, start) for start, buffers in requests]
            finally:
                os.close(fd)
        sizes = [sum(memoryview(b).nbytes for b in buffers) for _, buffers in requests]
        path = self.path(rel)
        starts = [start for start, _ in requests]
        data = self.fs.cat_ranges([path] * len(requests), starts, [s + n for s, n in zip(starts, sizes)], on_error="raise")
        for (_, buffers), chunk in zip(requests, data):
            pos = 0
            for b in buffers:
                view = memoryview(b).cast("B")
                piece = chunk[pos : pos + view.nbytes]
                view[: len(piece)] = piece
                pos += view.nbytes
        return [len(chunk) for chunk in data]

    def open_read(self, rel: str):
        """A binary file object for streaming a whole file."""
        if self.local is not None:
            return open(self.local / rel, "rb")
        return self.fs.open(self.path(rel), "rb")

    def size(self, rel: str) -> int:
        """Size in bytes; FileNotFoundError if missing."""
        if self.local is not None:
            return (self.local / rel).stat().st_size
        self.fs.invalidate_cache(self.path(rel))
        info = self.fs.info(self.path(rel))
        if info.get("type") != "file":
            raise FileNotFoundError(self.describe(rel))
        return int(info["size"])

    def exists(self, rel: str) -> bool:
        if self.local is not None:
            return (self.local / rel).exists()
        self.fs.invalidate_cache(self.path(rel))
        return self.fs.exists(self.path(rel))

    def list_dirs(self) -> list[str]:
        """Names of the directories (or object prefixes) directly under the root."""
        if self.local is not None:
            if not self.local.is_dir():
                return []
            return sorted(p.name for p in self.local.iterdir() if p.is_dir())
        self.fs.invalidate_cache(self.root)  # object-store listings are cached by fsspec
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

    # -- removing ------------------------------------------------------------
    def remove_tree(self, rel: str) -> None:
        if self.local is not None:
            shutil.rmtree(self.local / rel, ignore_errors=True)
            return
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass

    def remove(self, rel: str) -> None:
        if self.local is not None:
            (self.local / rel).unlink(missing_ok=True)
            return
        try:
            self.fs.rm_file(self.path(rel))
        except FileNotFoundError:
            pass

    def sync_dir(self, rel: str = "") -> None:
        """Make the entries of a directory durable (local files; object stores have no directories)."""
        if self.local is not None:
            _fsync_dir(self.local / rel if rel else self.local)

    def makedirs(self) -> None:
        if self.local is not None:
            self.local.mkdir(parents=True, exist_ok=True)
        else:
            self.fs.makedirs(self.root, exist_ok=True)


def _preadv(fd: int, buffers: list, start: int) -> int:
    """Fill `buffers` from byte `start` of `fd`, looping over short reads; returns the bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    done, first = 0, 0
    while first < len(views):
        n = os.preadv(fd, views[first : first + _IOV_MAX], start + done)
        if n == 0:
            break
        done += n
        while first < len(views) and n >= views[first].nbytes:
            n -= views[first].nbytes
            first += 1
        if n:
            views[first] = views[first][n:]
    return done


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- data-file writes: staged, checksummed in the copy, O_DIRECT where possible ---------------------------------
_free_stages: list[list[memoryview]] = []
_stages_lock = threading.Lock()


def _take_stages() -> list[memoryview]:
    """A set of page-aligned staging buffers, reused across saves (fresh memory costs page faults on every touch)."""
    with _stages_lock:
        if _free_stages:
            return _free_stages.pop()
    return [memoryview(mmap.mmap(-1, STAGE_BYTES)) for _ in range(STAGES)]


def _return_stages(stages: list[memoryview]) -> None:
    with _stages_lock:
        if len(_free_stages) < 2:
            _free_stages.append(stages)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class _DirectFile:
    """A file written at aligned offsets with O_DIRECT, falling back to the page cache where that is refused."""

    def __init__(self, path: Path):
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.fd, self.direct = None, False
        if _O_DIRECT:
            try:
                self.fd, self.direct = os.open(path, flags | _O_DIRECT, 0o644), True
            except OSError:
                pass
        if self.fd is None:
            self.fd = os.open(path, flags, 0o644)

    def pwrite(self, view: memoryview, offset: int) -> None:
        if self.direct:
            try:
                _pwrite_all(self.fd, view, offset)
                return
            except OSError as exc:
                if exc.errno not in (22, 95):  # EINVAL, EOPNOTSUPP: this filesystem takes no direct I/O after all
                    raise
                os.close(self.fd)
                self.fd, self.direct = os.open(self.path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)), False
        _pwrite_all(self.fd, view, offset)

    def close(self) -> None:
        os.close(self.fd)


def _write_local(path: Path, buffers: Iterable, durable: bool) -> int:
    """Write a file from a stream of buffers: copied into staging buffers on this thread, `pwrite` on another; returns its size.

    The copy reads each buffer right after the caller produced it (a writer
    that checksums a block and then yields it has it in cache), and the
    previous staging buffer is being written meanwhile.
    """
    f = _DirectFile(path)
    stages = _take_stages()
    pending: list[Future | None] = [None] * len(stages)
    slot, fill, base = 0, 0, 0  # current staging buffer, bytes in it, its file offset
    ok = False
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-pwrite") as io:

            def flush(nbytes: int) -> None:
                nonlocal slot, fill, base
                pending[slot] = io.submit(f.pwrite, stages[slot][:nbytes], base)
                base += fill
                slot, fill = (slot + 1) % len(stages), 0
                if pending[slot] is not None:
                    pending[slot].result()  # the next buffer is free once its write is done (a write error raises here)
                    pending[slot] = None

            for buf in buffers:
                src = memoryview(buf).cast("B")
                i = 0
                while i < src.nbytes:
                    k = min(src.nbytes - i, STAGE_BYTES - fill)
                    stages[slot][fill : fill + k] = src[i : i + k]
                    fill, i = fill + k, i + k
                    if fill == STAGE_BYTES:
                        flush(STAGE_BYTES)
            size = base + fill
            if fill:
                padded = -(-fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
                stages[slot][fill:padded] = bytes(padded - fill)
                flush(padded)  # O_DIRECT writes whole blocks; the file is cut back to `size` below
            for p in pending:
                if p is not None:
                    p.result()
        if size % _DIRECT_ALIGN:
            os.ftruncate(f.fd, size)
        if durable:
            os.fsync(f.fd)
        ok = True
    finally:
        f.close()
        if ok:
            _return_stages(stages)
    return size
