"""Where checkpoint bytes live: one root URI, relative paths below it.

Plain paths and `file://` go straight to the OS: sequential unbuffered writes
of large buffers, `fsync` before a save reports done, `preadv` straight into the destination
buffers for range reads,
and an atomic rename for the manifest (the commit). Everything else
(`memory://`, `s3://`, any fsspec protocol) goes through fsspec, whose
`cat_ranges` fetches many byte ranges concurrently on object stores and whose
single PUT of a small object is atomic there.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

import fsspec

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


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
            with open(target, "wb", buffering=0) as f:
                for buf in buffers:
                    mv = memoryview(buf).cast("B")
                    while mv:
                        mv = mv[f.write(mv):]
                if durable:
                    os.fsync(f.fileno())
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
