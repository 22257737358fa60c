"""Where checkpoint bytes live: one root URI, relative paths below it.

Plain paths and `file://` go straight to the OS. Files are written with
`O_DIRECT` where the filesystem allows it: the buffers are copied into reused,
page-aligned staging buffers while a writer thread `pwrite`s the previous
one -- no page-cache copy, no pile of dirty pages left for `fsync` to flush.
(Where direct I/O is refused, e.g. tmpfs, the same pipeline writes through
the page cache.) Every file is `fsync`ed before a save reports
done, and its directory too. Range reads `preadv` straight into the
destination buffers; the manifest (the commit) is published by an atomic rename. Below the root
no symbolic link is ever followed (reads, writes and deletes walk the path
with `O_NOFOLLOW` from a descriptor of the root, which itself may be a link
the user chose): a planted link cannot make a checkpoint operation read,
overwrite or delete anything outside. Everything else
(`memory://`, `s3://`, any fsspec protocol) goes through fsspec, whose
`cat_ranges` fetches many byte ranges concurrently on object stores and whose
single PUT of a small object is atomic there.

On `s3://` the two bulk paths, data-file writes and range reads, go through
pyarrow's `S3FileSystem` instead (`bench/s3.py`, `bench/README.md`): its
multipart upload and its `read_at` run in C++ without the GIL, and cost the
client about a fifth (writes) and four fifths (reads) of s3fs's CPU per byte,
at the same throughput against a test server that is the bottleneck -- CPU and
GIL time that a background save no longer takes from training. It is built
from the settings s3fs itself resolved
(endpoint and region of s3fs's client, credentials from `storage_options` or
the standard AWS chain); a Store whose `storage_options` (or proxy
environment) pyarrow can't honour keeps s3fs for everything. Listings, small
files, deletes, the bucket creation and the manifest's single atomic PUT stay
on s3fs, where pyarrow gains nothing.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import fsspec
import numpy

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)
STAGE_BYTES = 8 << 20
"""Size of one staging buffer of a data-file write (a multiple of the page size)."""
STAGES = 3
"""Staging buffers per write: one being filled, up to two being written."""
_DIRECT_ALIGN = 4096
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC


class SymlinkRefused(OSError):
    """A path below a checkpoint root runs through a symbolic link, which is never followed there."""


class Store:
    """Byte-level access to the files under one checkpoint root."""

    def __init__(self, uri: str, storage_options: dict | None = None):
        self.uri = uri.rstrip("/") or "/"
        self.arrow = None
        """pyarrow's S3FileSystem for data-file writes and range reads (s3:// only, where the settings map)."""
        if "://" not in uri or uri.startswith("file://"):
            self.local: Path | None = Path(uri.removeprefix("file://")).expanduser()
            self.fs = None
            self.root = str(self.local)
        else:
            self.local = None
            self.fs, self.root = fsspec.core.url_to_fs(self.uri, **(storage_options or {}))
            self.root = self.root.rstrip("/")
            if "s3" in _protocols(self.fs):
                self.arrow = _arrow_s3(self.fs, self.root.split("/", 1)[0], storage_options or {})

    @property
    def backend(self) -> str:
        """What moves the bulk bytes (data-file writes, range reads): "os", "pyarrow" or "fsspec"."""
        return "os" if self.local is not None else "pyarrow" if self.arrow is not None else "fsspec"

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def describe(self, rel: str) -> str:
        """The file's URI, for error messages."""
        return f"{self.uri}/{rel}" if rel else self.uri

    # -- writing -------------------------------------------------------------
    def write(self, rel: str, buffers: Iterable, *, durable: bool = True) -> None:
        """Write a file from a sequence of byte buffers; with `durable`, it is on stable storage on return."""
        if self.local is not None:
            with self._parent(rel, create=True) as (fd, name):
                if durable:
                    _write_local(fd, name, rel, buffers, durable=True)
                    os.fsync(fd)
                else:
                    _write_plain(fd, name, rel, buffers)
            return
        self.fs.makedirs(self.path(rel).rsplit("/", 1)[0], exist_ok=True)  # on S3: creates a missing bucket
        if self.arrow is not None:
            with self.arrow.open_output_stream(self.path(rel), compression=None) as f:
                for buf in buffers:
                    view = memoryview(buf).cast("B")
                    # Slices below the smallest part size are copied into the part being filled (never kept by
                    # reference), so a caller may reuse a buffer once it is handed on, as with the other paths.
                    for i in range(0, view.nbytes, _ARROW_SLICE):
                        f.write(view[i : i + _ARROW_SLICE])
            return
        with self.fs.open(self.path(rel), "wb") as f:
            for buf in buffers:
                f.write(memoryview(buf).cast("B"))

    def write_mapped(self, rel: str, size: int, buffers: Iterable, maps: FileMaps) -> None:
        """Overwrite a local file that need not outlive the machine with `size` bytes of `buffers`, through its map
        in `maps` (kept from one write to the next); elsewhere, `write` it."""
        if self.local is None:
            self.write(rel, buffers, durable=False)
            return
        self.fill_mapped(rel, size, lambda view: _copy_into(view, buffers), maps)

    def fill_mapped(self, rel: str, size: int, fill: Callable[[memoryview], None], maps: FileMaps) -> None:
        """Overwrite a local file with `size` bytes that `fill(view)` writes straight into its map (a socket's
        `recv_into`: no buffer between the kernel and the file), which `maps` keeps from one write to the next."""
        if self.local is None:
            raise ValueError(f"{self.describe(rel)} is not a local file: it has no map to fill")
        with self._parent(rel, create=True) as (dir_fd, name):
            fd = _open_at(dir_fd, name, os.O_RDWR | os.O_CREAT, rel)
            try:
                maps.fill(fd, size, fill)
            finally:
                os.close(fd)

    def write_atomic(self, rel: str, data: bytes, *, publish_if: Callable[[], bool] | None = None, durable: bool = True) -> bool:
        """Publish a small file all at once: readers see the old state or the whole new file, never a part.

        `publish_if()` is asked at the last moment, once the bytes are on
        stable storage and only the rename (one PUT on object stores) is left:
        when it says False nothing is published and this returns False. A
        caller that gave up on a slow write (its deadline passed) fences it so.
        """
        if self.local is not None:
            with self._parent(rel, create=True) as (fd, name):
                tmp = f".{name}.{uuid.uuid4().hex}.tmp"
                if durable:
                    _write_local(fd, tmp, rel, [data], durable=True)
                else:
                    _write_plain(fd, tmp, rel, [data])
                if publish_if is not None and not publish_if():
                    os.unlink(tmp, dir_fd=fd)
                    return False
                os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)  # replaces a link planted there, never its target
                if durable:
                    os.fsync(fd)
            return True
        if publish_if is not None and not publish_if():
            return False
        self.fs.pipe_file(self.path(rel), data)
        return True

    def create_new(self, rel: str, data: bytes) -> bool:
        """Publish a small file only where none exists; False if one does.

        Local files: atomic and complete (a temporary file, hard-linked to the
        name, which fails if the name exists). Object stores have no such
        operation here: a check, then a single PUT, so two writers may both
        see True; callers read back to detect that (see `storage.lease`).
        """
        if self.local is not None:
            with self._parent(rel, create=True) as (fd, name):
                tmp = f".{name}.{uuid.uuid4().hex}.tmp"
                _write_local(fd, tmp, rel, [data], durable=True)
                try:
                    os.link(tmp, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                    return True
                except FileExistsError:
                    return False
                finally:
                    os.unlink(tmp, dir_fd=fd)
                    os.fsync(fd)
        if self.exists(rel):
            return False
        self.write_atomic(rel, data)
        return True

    def rename(self, rel: str, new_rel: str) -> None:
        """Atomically move a local file to another name in the same directory (FileNotFoundError if it is gone)."""
        if self.local is None:
            raise NotImplementedError("rename: local files only")
        with self._parent(rel) as (fd, name):
            head, _, new_name = new_rel.rpartition("/")
            if head != rel.rpartition("/")[0]:
                raise ValueError(f"rename: {rel!r} and {new_rel!r} are not in one directory")
            _parts(new_name)
            os.rename(name, new_name, src_dir_fd=fd, dst_dir_fd=fd)

    # -- reading -------------------------------------------------------------
    def read(self, rel: str) -> bytes:
        if self.local is not None:
            with os.fdopen(self._open_file(rel), "rb") as f:
                return f.read()
        return self.fs.cat_file(self.path(rel))

    def read_into(self, rel: str, requests: list[tuple[int, list]]) -> list[int]:
        """Scatter reads: for each (start, buffers), fill the writable buffers back to back from byte `start`.

        Returns the bytes read per request (fewer where the file ends early).
        Local files take one `preadv` per request, straight into the buffers.
        """
        if self.local is not None:
            fd = self._open_file(rel)
            try:
                return [_preadv(fd, buffers, start) for start, buffers in requests]
            finally:
                os.close(fd)
        if self.arrow is not None:
            return self._arrow_read_into(rel, requests)
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

    def _arrow_read_into(self, rel: str, requests: list[tuple[int, list]]) -> list[int]:
        """`read_into` over pyarrow: every request cut into chunks of at most `RANGE_CHUNK`, read concurrently."""
        with self.arrow.open_input_file(self.path(rel)) as f:  # FileNotFoundError if missing
            size = f.size()
            got, jobs = [], []
            for start, buffers in requests:
                views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
                n = max(0, min(sum(v.nbytes for v in views), size - start))  # what the file holds of this range
                got.append(n)
                pos, vi, vo = 0, 0, 0  # bytes planned, current view, offset in it
                while pos < n:
                    k = min(RANGE_CHUNK, n - pos)
                    targets, left = [], k
                    while left:
                        take = min(left, views[vi].nbytes - vo)
                        targets.append(views[vi][vo : vo + take])
                        vo, left = vo + take, left - take
                        if vo == views[vi].nbytes:
                            vi, vo = vi + 1, 0
                    jobs.append((start + pos, k, targets))
                    pos += k
            futures = [_range_pool().submit(_read_chunk, f, *job) for job in jobs]
            wait_futures(futures)  # all done (none still writing into the buffers) before any error is raised
            for future in futures:
                future.result()
        return got

    def open_read(self, rel: str):
        """A binary file object for streaming a whole file."""
        if self.local is not None:
            return os.fdopen(self._open_file(rel), "rb")
        return self.fs.open(self.path(rel), "rb")

    def size(self, rel: str) -> int:
        """Size in bytes; FileNotFoundError if missing."""
        if self.local is not None:
            with self._parent(rel) as (fd, name):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise SymlinkRefused(errno.ELOOP, _LINK_REFUSED.format(rel))
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", rel)
            return st.st_size
        self.fs.invalidate_cache(self.path(rel))
        info = self.fs.info(self.path(rel))
        if info.get("type") != "file":
            raise FileNotFoundError(self.describe(rel))
        return int(info["size"])

    def exists(self, rel: str) -> bool:
        """Whether anything is there (a link too); SymlinkRefused if the path runs through one."""
        if self.local is not None:
            try:
                with self._parent(rel) as (fd, name):
                    os.stat(name, dir_fd=fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return False
            return True
        self.fs.invalidate_cache(self.path(rel))
        return self.fs.exists(self.path(rel))

    def list_dirs(self) -> list[str]:
        """Names of the directories (or object prefixes) directly under the root, and of links there (never followed)."""
        if self.local is not None:
            if not self.local.is_dir():
                return []
            with os.scandir(self.local) as entries:
                return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False) or e.is_symlink())
        self.fs.invalidate_cache(self.root)  # object-store listings are cached by fsspec
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

    def list_files(self) -> list[str]:
        """Names of the files (or objects) directly under the root."""
        if self.local is not None:
            if not self.local.is_dir():
                return []
            return sorted(p.name for p in self.local.iterdir() if p.is_file())
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rsplit("/", 1)[-1] for e in entries if e.get("type") == "file")

    # -- removing ------------------------------------------------------------
    def remove_tree(self, rel: str) -> None:
        """Delete a directory and everything in it; a link there is removed itself, what it points to stays."""
        if self.local is not None:
            try:
                with self._parent(rel) as (fd, name):
                    if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        shutil.rmtree(name, dir_fd=fd, ignore_errors=True)  # fd-based: follows no link inside
                    else:
                        os.unlink(name, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError, SymlinkRefused):
                pass  # nothing of this checkpoint there
            return
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass

    def remove(self, rel: str) -> None:
        if self.local is not None:
            try:
                with self._parent(rel) as (fd, name):
                    os.unlink(name, dir_fd=fd)  # a link is removed itself, never its target
            except (FileNotFoundError, NotADirectoryError, SymlinkRefused):
                pass  # nothing of this checkpoint there
            return
        try:
            self.fs.rm_file(self.path(rel))
        except FileNotFoundError:
            pass

    def sync_dir(self, rel: str = "") -> None:
        """Make the entries of a directory durable (local files; object stores have no directories)."""
        if self.local is not None:
            fd = self._open_dir(rel)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def makedirs(self) -> None:
        if self.local is not None:
            self.local.mkdir(parents=True, exist_ok=True)
        else:
            self.fs.makedirs(self.root, exist_ok=True)

    # -- local paths, walked without following links ----------------------------------------------------------
    def _open_dir(self, rel: str, *, create: bool = False) -> int:
        """A descriptor of the directory `rel` below the root (created with `create`), no link followed on the way."""
        parts = _parts(rel)
        try:
            fd = os.open(self.local, _DIR_FLAGS)  # the root itself may be a link: the user chose it
        except FileNotFoundError:
            if not create:
                raise
            self.local.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.local, _DIR_FLAGS)
        try:
            for i, name in enumerate(parts):
                try:
                    sub = _open_subdir(fd, name, create)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, fd):
                        raise SymlinkRefused(errno.ELOOP, _LINK_REFUSED.format("/".join(parts[: i + 1]))) from None
                    raise
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextmanager
    def _parent(self, rel: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """(descriptor of the parent directory, file name) of `rel`, for the `*at` calls."""
        head, _, name = rel.rpartition("/")
        _parts(name)
        fd = self._open_dir(head, create=create)
        try:
            yield fd, name
        finally:
            os.close(fd)

    def _open_file(self, rel: str) -> int:
        """A read-only descriptor of the file `rel`; SymlinkRefused if it, or a directory above it, is a link."""
        with self._parent(rel) as (fd, name):
            return _open_at(fd, name, os.O_RDONLY, rel)


_LINK_REFUSED = "{} is a symbolic link (links are not followed below the checkpoint root)"


def _parts(rel: str) -> list[str]:
    """The components of a path below the root; anything that could leave it is a bug of the caller."""
    parts = rel.split("/") if rel else []
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{rel!r} is not a path below the checkpoint root")
    return parts


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_subdir(dir_fd: int, name: str, create: bool) -> int:
    """A descriptor of the directory `name` in `dir_fd`, not through a link; made first where it is missing and
    `create`. Opened before any `mkdir`: the memory tier opens the same few directories several times a step, where
    an `mkdir` that finds the directory there still takes its parent's lock (80-110 us each in a busy job, bench/README.md)."""
    try:
        return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, dir_fd=dir_fd)
    except FileExistsError:
        pass  # made meanwhile
    return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)


def _open_at(dir_fd: int, name: str, flags: int, shown: str, mode: int = 0o644) -> int:
    """`os.open` of a name in a directory without following a link there; `shown` names the file in the error."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SymlinkRefused(errno.ELOOP, _LINK_REFUSED.format(shown)) from None
        raise


# -- s3:// bulk bytes through pyarrow -----------------------------------------------------------------------------
RANGE_CHUNK = 16 << 20
"""Range reads through pyarrow are split into GETs of at most this size, run concurrently."""
RANGE_THREADS = 16
"""GETs in flight for range reads through pyarrow, over all stores of the process."""
_ARROW_SLICE = 1 << 20
_range_threads: ThreadPoolExecutor | None = None
_arrow_cache: dict[str, object] = {}
_arrow_lock = threading.Lock()

# s3fs options that change nothing on the data path; anything else pyarrow can't take sends the Store to s3fs.
_S3FS_NEUTRAL = frozenset(
    {
        "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "default_block_size",
        "default_fill_cache", "default_cache_type", "cache_regions", "max_concurrency", "fixed_upload_size",
        "local_expiry_check",
    }
)
_CLIENT_KWARGS = frozenset({"region_name", "endpoint_url", "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "use_ssl"})
_ENV = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_DEFAULT_REGION", "AWS_REGION",
    "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "AWS_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy",
)


def _protocols(fs) -> tuple:
    p = getattr(fs, "protocol", ())
    return (p,) if isinstance(p, str) else tuple(p)


def _range_pool() -> ThreadPoolExecutor:
    global _range_threads
    with _arrow_lock:
        if _range_threads is None:
            _range_threads = ThreadPoolExecutor(max_workers=RANGE_THREADS, thread_name_prefix="ckpt-s3-range")
        return _range_threads


def _read_chunk(f, offset: int, nbytes: int, targets: list[memoryview]) -> None:
    data = f.read_at(nbytes, offset)  # a GET straight into a new bytes object, without the GIL
    if len(data) != nbytes:
        raise OSError(f"short read: {len(data)} of {nbytes} bytes at {offset}")
    src, pos = memoryview(data), 0
    for t in targets:
        t[:] = src[pos : pos + t.nbytes]
        pos += t.nbytes


def _arrow_s3(fs, bucket: str, options: dict):
    """A pyarrow S3FileSystem with the settings of the s3fs filesystem `fs`, or None where they can't be mapped.

    Built once per (options, AWS environment, bucket) in a process.
    """
    key = json.dumps([options, [os.environ.get(k) for k in _ENV], bucket], sort_keys=True, default=repr)
    with _arrow_lock:
        if key in _arrow_cache:
            return _arrow_cache[key]
    try:
        kwargs = _arrow_kwargs(fs, bucket, options)
        if kwargs is not None:
            import pyarrow.fs

            arrow = pyarrow.fs.S3FileSystem(**kwargs)
        else:
            arrow = None
    except Exception:  # noqa: BLE001 - whatever pyarrow can't do here, s3fs still can
        arrow = None
    with _arrow_lock:
        _arrow_cache[key] = arrow
    return arrow


def _first(*values):
    return next((v for v in values if v is not None), None)


def _arrow_kwargs(fs, bucket: str, options: dict) -> dict | None:
    """S3FileSystem arguments equivalent to s3fs's settings (`options` and what its client resolved), or None."""
    opts = {k: v for k, v in options.items() if k not in _S3FS_NEUTRAL}
    client = dict(opts.pop("client_kwargs", None) or {})
    if set(client) - _CLIENT_KWARGS:
        return None
    for name in ("requester_pays", "version_aware", "config_kwargs", "s3_additional_kwargs", "session"):
        if opts.pop(name, None):
            return None  # pyarrow has no equivalent (or none that maps one to one)
    key = _first(opts.pop("key", None), opts.pop("username", None), client.get("aws_access_key_id"))
    secret = _first(opts.pop("secret", None), opts.pop("password", None), client.get("aws_secret_access_key"))
    token = _first(opts.pop("token", None), client.get("aws_session_token"))
    anon = bool(opts.pop("anon", False))
    opts.pop("endpoint_url", None)
    opts.pop("use_ssl", None)  # these two are read back from s3fs's client below
    if opts or (key is None) != (secret is None):
        return None  # an option pyarrow does not know (e.g. profile), or a key without its secret
    meta = fs.s3.meta  # s3fs's botocore client (connects it: no request is sent)
    url = urlsplit(meta.endpoint_url)
    if url.scheme not in ("http", "https") or not url.hostname or url.path not in ("", "/"):
        return None
    kwargs: dict = {"scheme": url.scheme, "allow_delayed_open": True}  # delayed open: a small file is a single PUT
    if url.hostname.endswith((".amazonaws.com", ".amazonaws.com.cn")):  # AWS itself
        if os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"):
            return None  # s3fs was told to ignore them; pyarrow might not be
        region = client.get("region_name") or fs.session.get_config_variable("region")
        if not region:  # botocore follows the bucket's region by redirects; pyarrow must be told
            import pyarrow.fs

            region = pyarrow.fs.resolve_s3_region(bucket)
        kwargs["region"] = region
    else:
        kwargs["endpoint_override"] = url.netloc
        kwargs["region"] = meta.region_name or "us-east-1"
    proxy = [os.environ.get(f"{url.scheme}_proxy"), os.environ.get(f"{url.scheme.upper()}_PROXY")]
    if any(proxy):
        return None  # botocore honours the proxy variables (and NO_PROXY); pyarrow would not
    if anon:
        kwargs["anonymous"] = True
    elif key is not None:
        kwargs.update(access_key=key, secret_key=secret, session_token=token)
    # else: the standard AWS chain (environment, shared config and credentials files, instance metadata), as botocore
    if os.environ.get("AWS_CA_BUNDLE"):
        kwargs["tls_ca_file_path"] = os.environ["AWS_CA_BUNDLE"]
    return kwargs


def _vectored(transfer, fd: int, views: list[memoryview], start: int) -> int:
    """`os.preadv` or `os.pwritev` of `views` from byte `start` of `fd`, looping over short transfers, up to an
    end of file; returns the bytes moved."""
    views = [v for v in views if v.nbytes]
    done, first = 0, 0
    while first < len(views):
        n = transfer(fd, views[first : first + _IOV_MAX], start + done)
        if n == 0:
            break
        done += n
        while first < len(views) and n >= views[first].nbytes:
            n -= views[first].nbytes
            first += 1
        if n:
            views[first] = views[first][n:]
    return done


def _preadv(fd: int, buffers: list, start: int) -> int:
    """Fill `buffers` from byte `start` of `fd`, looping over short reads; returns the bytes read."""
    return _vectored(os.preadv, fd, [memoryview(b).cast("B") for b in buffers], start)


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
    """A file written at aligned offsets with O_DIRECT, falling back to the page cache where that is refused.

    Opened by name in its directory's descriptor, never through a link (`shown` names it in errors).
    """

    def __init__(self, dir_fd: int, name: str, shown: str):
        self.dir_fd, self.name, self.shown = dir_fd, name, shown
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.fd, self.direct = None, False
        if _O_DIRECT:
            try:
                self.fd, self.direct = _open_at(dir_fd, name, flags | _O_DIRECT, shown), True
            except SymlinkRefused:
                raise
            except OSError:
                pass
        if self.fd is None:
            self.fd = _open_at(dir_fd, name, flags, shown)

    def pwrite(self, view: memoryview, offset: int) -> None:
        if self.direct:
            try:
                _pwrite_all(self.fd, view, offset)
                return
            except OSError as exc:
                if exc.errno not in (22, 95):  # EINVAL, EOPNOTSUPP: this filesystem takes no direct I/O after all
                    raise
                os.close(self.fd)
                self.fd, self.direct = _open_at(self.dir_fd, self.name, os.O_WRONLY, self.shown), False
        _pwrite_all(self.fd, view, offset)

    def close(self) -> None:
        os.close(self.fd)


_PLAIN_BATCH = 2 << 20
"""`_write_plain` hands the kernel its buffers in batches of about this many bytes, still in cache from their checksum:
one system call, and one release of the GIL, for many small pieces (a memory snapshot's writer thread shares the GIL
with the rank's training loop)."""


def _write_plain(dir_fd: int, name: str, shown: str, buffers: Iterable) -> int:
    """Write a file straight into the page cache (RAM on /dev/shm), in batches of buffers; returns its size.

    For files that need not outlive the machine (the memory tier's): no
    staging copy, no writer thread, no fsync, which on small files cost more
    than the bytes. A buffer may be held until a batch is full, so the
    caller must not overwrite one it has handed over before this returns. A file already there is overwritten in place and cut to
    the new size: its pages are reused, not freed and allocated again.
    """
    fd = _open_at(dir_fd, name, os.O_WRONLY | os.O_CREAT, shown)
    size, batch, batched = 0, [], 0
    try:
        for buf in buffers:
            view = memoryview(buf).cast("B")
            batch.append(view)
            batched += view.nbytes
            if batched >= _PLAIN_BATCH or len(batch) >= _IOV_MAX:
                size += _vectored(os.pwritev, fd, batch, size)
                batch, batched = [], 0
        size += _vectored(os.pwritev, fd, batch, size)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return size


def _copy_into(target: memoryview, buffers: Iterable) -> None:
    """Copy `buffers`, back to back, into all of `target` (each copy releases the GIL)."""
    out, pos = numpy.frombuffer(target, dtype=numpy.uint8), 0
    try:
        for buf in buffers:
            view = numpy.frombuffer(buf, dtype=numpy.uint8)  # any contiguous buffer, read as its bytes
            if pos + view.nbytes > out.nbytes:
                raise ValueError(f"more than the {out.nbytes} bytes announced")
            numpy.copyto(out[pos : pos + view.nbytes], view)
            pos += view.nbytes
    finally:
        del out  # nothing may view the target once this returns
    if pos != target.nbytes:
        raise ValueError(f"{pos} bytes written of the {target.nbytes} announced")


class FileMaps:
    """Writable maps of the files a writer overwrites again and again (a rank's memory-tier files, the replicas a node
agent receives), kept between writes.

    Storing through a map is a plain copy: no system call, no page-cache
    lookup per page, as a `pwritev` has (measured alone on a 7 MB snapshot of
    84 pieces, checksums included: 0.63 ms of CPU against 1.02 ms). The copy
    releases the GIL, as a system call does. A new map's pages are allocated
    first (`posix_fallocate`): on a full RAM-backed filesystem that is an
    ENOSPC error there, never a SIGBUS in the middle of a copy. A file that
    cannot be mapped (a filesystem without shared maps) is filled through a
    buffer and written instead. At most `keep`
    maps are kept (the newest used), and none of a file that is gone, whose
    pages would otherwise outlive it.
    """

    def __init__(self, keep: int = 2):
        self._keep = keep
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap | None]] = {}  # by (device, inode): own descriptor, map

    def fill(self, fd: int, size: int, fill: Callable[[memoryview], None]) -> int:
        """Overwrite the file open as `fd` (which stays the caller's) with `size` bytes: `fill(view)` writes every
        byte of the map's writable view, and keeps no reference to it. Returns `size`."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        held = self._maps.pop(key, None)
        if held is not None and (st.st_size != size or (held[1] is not None and len(held[1]) != size)):
            self._close(held)
            held = None
        if held is None:
            os.posix_fallocate(fd, 0, max(size, 1))
            os.ftruncate(fd, size)
            own = os.dup(fd)
            try:
                held = (own, mmap.mmap(own, size) if size else None)
            except OSError:  # a filesystem without shared maps (some FUSE and network ones): written as a file
                os.close(own)
                return _fill_written(fd, size, fill)
        self._maps[key] = held  # the newest last
        self._trim()
        view = memoryview(held[1] if held[1] is not None else bytearray())
        try:
            fill(view)
        finally:
            view.release()  # the map can close only once nothing views it
        return size

    def _trim(self) -> None:
        for key in [k for k, (fd, _) in self._maps.items() if os.fstat(fd).st_nlink == 0]:
            self._close(self._maps.pop(key))
        while len(self._maps) > self._keep:
            self._close(self._maps.pop(next(iter(self._maps))))

    @staticmethod
    def _close(held: tuple[int, mmap.mmap | None]) -> None:
        if held[1] is not None:
            held[1].close()
        os.close(held[0])

    def close(self) -> None:
        while self._maps:
            self._close(self._maps.popitem()[1])


def _fill_written(fd: int, size: int, fill: Callable[[memoryview], None]) -> int:
    """`FileMaps.fill` where the file cannot be mapped: `fill` writes into a buffer, which is then written out."""
    buf = bytearray(size)
    view = memoryview(buf)
    try:
        fill(view)
        _pwrite_all(fd, view, 0)
    finally:
        view.release()
    return size


def _write_local(dir_fd: int, name: str, shown: str, buffers: Iterable, durable: bool) -> int:
    """Write a file from a stream of buffers: copied into staging buffers on this thread, `pwrite` on another; returns its size.

    The copy reads each buffer right after the caller produced it (a writer
    that checksums a block and then yields it has it in cache), and the
    previous staging buffer is being written meanwhile.
    """
    f = _DirectFile(dir_fd, name, shown)
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
