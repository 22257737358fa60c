"""Tokenized corpora as training windows: Parquet, Arrow IPC and flat `.bin` token files, local or on any fsspec store.

Packing, a pure function of the file list and the config (sample index ->
tokens, whatever the layout, the process or the restart):

- the files, sorted by path, are read in order; a Parquet or Arrow row (a
  list of token ids in `data.column`) is one document, followed by
  `data.eos_token` when that is set; a `.bin` file (uint16 or uint32,
  `data.dtype`, the nanoGPT / Megatron convention) is already a stream and is
  taken as it is;
- all of it is one token stream, and window i is its tokens
  [i * L, i * L + L + 1) for L = `data.seq_len`: inputs are the first L,
  labels the last L. Neighbouring windows share one token, so every token
  but the first is a label exactly once per epoch. Windows run across
  document and file boundaries; the tail too short for a window is dropped.

Reading never loads the corpus. The driver indexes it once
(`index_corpus`): each file's size and the tokens of each of its chunks, a
Parquet row group (counted from the footer: leaf values less nulls, no data
read), an Arrow record batch (the offsets of its list column, memory-mapped
locally) or a whole `.bin` file (its size). Ranks receive the index as JSON
and find a window's chunk by binary search. `.bin` files are memory-mapped
locally and read by byte range remotely (a batch's ranges fetched
concurrently); a Parquet chunk is its row group's one column, decoded into a
bounded LRU (`data.cache_mb`); Arrow batches are zero-copy views of the
memory map locally, read whole into the same LRU remotely. So a rank holds
the index (a few numbers per chunk), the pages it touches and the LRU.

Remote Parquet and Arrow chunks are fetched and decoded on one background
thread per reader (pyarrow releases the GIL while it waits and decodes; one
thread, so no open file is ever read by two threads at once), and a reader
that misses chunks in stream order (the second neighbour in a row) reads up
to `READ_AHEAD` chunks ahead, a Parquet file's neighbouring row groups in
one coalesced request: a sequential pass makes a few requests per file
rather than one per row group, and waits on the store about once. Those
chunks are held beside the LRU until asked for: at most a quarter of
`data.cache_mb` more.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from bisect import bisect_right
from collections import OrderedDict, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate, groupby
from pathlib import Path

import numpy as np

from elastic.config import ConfigError, DataConfig
from storage.fs import Store

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow", ".ipc": "arrow", ".feather": "arrow", ".bin": "bin"}
"""File suffixes a corpus may hold, and how each is read."""
OPEN_FILES = 64
"""Files a reader keeps open (memory maps, Parquet footers): the least recently used is closed past this."""
READ_AHEAD = 8
"""Remote chunks read ahead of a reader that goes through the stream in order (fewer where they would pass a quarter of the cache)."""
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class CorpusFile:
    rel: str
    """Path below the corpus root."""
    size: int
    format: str
    chunks: tuple[int, ...]
    """Tokens of each chunk (row group, record batch, whole .bin file), separators included."""


@dataclass(frozen=True)
class CorpusIndex:
    """Where a corpus's tokens are: its files in stream order with their chunk sizes. JSON in, JSON out."""

    root: str
    files: tuple[CorpusFile, ...]

    @property
    def tokens(self) -> int:
        return sum(sum(f.chunks) for f in self.files)

    def fingerprint(self) -> str:
        """Hash of the file list and sizes: a corpus that changed (a file added, removed, rewritten to another size) differs."""
        listing = json.dumps([[f.rel, f.size] for f in self.files])
        return hashlib.sha256(listing.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {"root": self.root, "files": [[f.rel, f.size, f.format, list(f.chunks)] for f in self.files]}

    @classmethod
    def from_json(cls, data: dict) -> "CorpusIndex":
        return cls(data["root"], tuple(CorpusFile(rel, size, fmt, tuple(chunks)) for rel, size, fmt, chunks in data["files"]))


def windows_in(tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens, neighbours sharing one, that a stream of `tokens` holds."""
    return max(0, (tokens - 1) // seq_len)


# -- finding the files ---------------------------------------------------------------------------------------------
def _store_for(root: str) -> Store:
    try:
        return Store(root)
    except (ImportError, ValueError) as exc:  # an unknown protocol, or its fsspec package is missing
        raise ConfigError(f"{root}: cannot open ({exc})") from None


def list_files(path: str, suffixes, field: str) -> tuple[str, list[tuple[str, int]]]:
    """The files with one of `suffixes` that `path` names (a file, a directory searched recursively, or a glob; any
    fsspec URI or a local path) as (root, [(path below root, size)]) sorted by path; ConfigError naming `field` if none."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    try:
        fs, p = fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as exc:  # an unknown protocol, or its fsspec package is missing
        raise ConfigError(f"{field} {path!r}: cannot open ({exc})") from None
    local = isinstance(fs, LocalFileSystem)
    p = os.path.abspath(p) if local else p.rstrip("/")
    try:
        if _GLOB.search(p):
            root, found = _glob_root(p), fs.glob(p, detail=True)
        else:
            info = fs.info(p)
            if info.get("type") == "directory":
                root, found = p, fs.find(p, detail=True)
            else:
                if Path(p).suffix not in suffixes:
                    raise ConfigError(f"{field} {path!r}: not a {' or '.join(dict.fromkeys(suffixes))} file")
                root, found = p.rsplit("/", 1)[0], {p: info}
    except FileNotFoundError:
        raise ConfigError(f"{field} {path!r}: no such file or directory") from None
    except OSError as exc:
        raise ConfigError(f"{field} {path!r}: cannot list ({type(exc).__name__}: {exc})") from None
    files = sorted(
        (name[len(root) + 1 :], int(info["size"]))
        for name, info in found.items()
        if info.get("type") == "file" and Path(name).suffix in suffixes
    )
    if not files:
        raise ConfigError(f"{field} {path!r}: matched no {' or '.join(dict.fromkeys(suffixes))} files")
    return (root or "/") if local else fs.unstrip_protocol(root), files


def _glob_root(pattern: str) -> str:
    """The directory part of `pattern` before its first glob character."""
    return pattern[: _GLOB.search(pattern).start()].rsplit("/", 1)[0]


def list_corpus(path: str, field: str = "data.path") -> tuple[str, list[tuple[str, int, str]]]:
    """The corpus root and its (relative path, size, format) in stream order; ConfigError naming `field` if none."""
    root, files = list_files(path, FORMATS, field)
    return root, [(rel, size, FORMATS[Path(rel).suffix]) for rel, size in files]


# -- indexing ------------------------------------------------------------------------------------------------------
def _open_arrow(store: Store, rel: str):
    """A pyarrow random-access file: a memory map locally, pyarrow's S3 client on s3://, fsspec elsewhere."""
    import pyarrow as pa

    if store.local is not None:
        return pa.memory_map(str(store.local / rel))
    if store.arrow is not None:
        return store.arrow.open_input_file(store.path(rel))
    return pa.PythonFile(store.fs.open(store.path(rel), "rb"), mode="r")


def _token_column(schema, column: str, where: str) -> None:
    import pyarrow as pa

    if column not in schema.names:
        raise ConfigError(f"data.column {column!r}: not in {where} (columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    nested = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    if not (nested and pa.types.is_integer(kind.value_type)):
        raise ConfigError(f"data.column {column!r} of {where} is {kind}, not a list of integer token ids")


def _decode(array, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (token values, document offsets); null rows are empty documents."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    values = array.flatten()
    if values.null_count:
        raise ValueError(f"{where}: null token ids in data.column")
    lengths = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return values.to_numpy(zero_copy_only=False), offsets


def _parquet_leaf(metadata, column: str) -> int:
    return next(j for j in range(metadata.num_columns) if metadata.schema.column(j).path.split(".")[0] == column)


def _index_parquet(store: Store, rel: str, cfg: DataConfig) -> list[int]:
    import pyarrow.parquet as pq

    where = store.describe(rel)
    pf = pq.ParquetFile(_open_arrow(store, rel))
    _token_column(pf.schema_arrow, cfg.column, where)
    md = pf.metadata
    leaf = _parquet_leaf(md, cfg.column)
    chunks = []
    for g in range(md.num_row_groups):
        group = md.row_group(g)
        meta = group.column(leaf)
        stats = meta.statistics
        if stats is not None and stats.has_null_count:
            tokens = meta.num_values - stats.null_count  # empty and null rows take one null slot each
        else:  # a writer that kept no statistics: count this group's tokens by reading its column once
            tokens = len(_decode(pf.read_row_group(g, columns=[cfg.column]).column(0), where)[0])
        chunks.append(tokens + (group.num_rows if cfg.eos_token is not None else 0))
    return chunks


class _ArrowBatches:
    """The record batches of an Arrow IPC file (random access) or, locally, stream (read once, zero-copy from the map)."""

    def __init__(self, store: Store, rel: str):
        import pyarrow as pa
        import pyarrow.ipc as ipc

        source = _open_arrow(store, rel)
        try:
            self._file = ipc.open_file(source)
            self.schema, self._batches = self._file.schema, None
            self.count = self._file.num_record_batches
        except pa.ArrowInvalid:
            if store.local is None:
                raise ConfigError(
                    f"{store.describe(rel)}: an Arrow IPC stream cannot be read by range on object storage; "
                    "write the IPC file format (pyarrow.ipc.new_file), Parquet or .bin"
                ) from None
            source.seek(0)
            reader = ipc.open_stream(source)
            self.schema, self._batches = reader.schema, list(reader)
            self.count = len(self._batches)

    def get(self, i: int):
        return self._batches[i] if self._batches is not None else self._file.get_batch(i)


def _index_arrow(store: Store, rel: str, cfg: DataConfig) -> list[int]:
    batches = _ArrowBatches(store, rel)
    where = store.describe(rel)
    _token_column(batches.schema, cfg.column, where)
    chunks = []
    for i in range(batches.count):
        batch = batches.get(i)
        tokens = len(batch.column(cfg.column).flatten())
        chunks.append(tokens + (batch.num_rows if cfg.eos_token is not None else 0))
    return chunks


def _index_file(store: Store, rel: str, size: int, fmt: str, cfg: DataConfig) -> CorpusFile:
    if fmt == "bin":
        itemsize = np.dtype(cfg.dtype).itemsize
        if size % itemsize:
            raise ConfigError(f"data.dtype {cfg.dtype}: {store.describe(rel)} has {size} bytes, not a whole number of {itemsize}-byte tokens")
        chunks = [size // itemsize]
    else:
        try:
            chunks = (_index_parquet if fmt == "parquet" else _index_arrow)(store, rel, cfg)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file: name it on one line
            raise ConfigError(f"data.path: cannot read {store.describe(rel)} as {fmt}: {type(exc).__name__}: {exc}") from None
    return CorpusFile(rel, size, fmt, tuple(int(n) for n in chunks))


def index_corpus(path: str, cfg: DataConfig, field: str = "data.path") -> CorpusIndex:
    """List and index a corpus (footers and sizes only, files in parallel); ConfigError naming the field on any problem."""
    root, files = list_corpus(path, field)
    store = _store_for(root)
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
        indexed = list(pool.map(lambda f: _index_file(store, *f, cfg), files))
    return CorpusIndex(root, tuple(indexed))


# -- reading -------------------------------------------------------------------------------------------------------
def stream_slice(values: np.ndarray, offsets: np.ndarray, eos: int | None, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of a chunk's stream: its documents (values cut at offsets), each followed by `eos` when set."""
    if eos is None:
        return values[start:stop]
    lengths = np.diff(offsets)
    doc_start = offsets[:-1] + np.arange(len(lengths))  # where each document begins in the stream (one eos per earlier doc)
    pos = np.arange(start, stop)
    doc = np.searchsorted(doc_start, pos, side="right") - 1
    within = pos - doc_start[doc]
    is_eos = within == lengths[doc]
    out = np.full(stop - start, eos, dtype=np.int64)
    out[~is_eos] = values[(offsets[doc] + within)[~is_eos]]
    return out


class _LRU:
    """Decoded chunks up to a byte budget; the newest entry stays even when it alone is larger."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict = OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self._items  # unlike get, leaves the order alone

    def get(self, key):
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key, value, nbytes: int) -> None:
        self._items[key] = (value, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes and len(self._items) > 1:
            _, (_, freed) = self._items.popitem(last=False)
            self.nbytes -= freed


class TokenReader:
    """Byte-range access to a corpus's token stream through its index; one per process, used by one thread."""

    def __init__(self, index: CorpusIndex, cfg: DataConfig):
        self.index = index
        self.cfg = cfg
        self.store = _store_for(index.root)
        self.dtype = np.dtype(cfg.dtype)
        # Python lists for the per-window loop: indexing and bisecting a list of a few ranges is several times cheaper than numpy.
        self._starts = [0, *accumulate(n for f in index.files for n in f.chunks)]
        self._chunk_file = [fi for fi, f in enumerate(index.files) for _ in f.chunks]
        self._chunk_local = [ci for f in index.files for ci in range(len(f.chunks))]
        self.cache = _LRU(cfg.cache_mb << 20)
        self._open: OrderedDict = OrderedDict()
        self._last_key: int | None = None
        self._last_chunk: tuple[np.ndarray, np.ndarray] | None = None
        self._fetcher: ThreadPoolExecutor | None = None  # the one thread that reads remote Parquet and Arrow chunks
        self._ahead: dict[int, tuple[Future, int]] = {}  # chunk (stream order) -> (its read, in flight or done; its place in it)
        self._last_miss = -2  # the last chunk read from the store (none yet: chunk 0 is not its neighbour)
        self.bytes_fetched = 0
        """Bytes read from remote files or decoded from Parquet column chunks (compressed size): what a read cost."""
        self.read_ahead_used = 0
        """Chunks that a read found already read ahead."""

    @property
    def tokens(self) -> int:
        return self._starts[-1]

    def read(self, ranges: list[tuple[int, int]], out: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """The stream's tokens [start, stop) for each range, as int64 (into `out` when given); remote .bin ranges are fetched together."""
        if out is None:
            out = [np.empty(stop - start, dtype=np.int64) for start, stop in ranges]
        if ranges and (min(start for start, _ in ranges) < 0 or max(stop for _, stop in ranges) > self.tokens):
            raise IndexError(f"token ranges outside the corpus's {self.tokens} tokens")
        starts, files, eos = self._starts, self.index.files, self.cfg.eos_token
        remote: dict[int, list] = defaultdict(list)  # .bin file -> [(lo, hi, destination)]
        for dest_all, (start, stop) in zip(out, ranges):
            c = bisect_right(starts, start) - 1  # the chunk holding token `start` (past any empty chunks before it)
            pos = start
            while pos < stop:
                chunk_start = starts[c]
                end = min(stop, starts[c + 1])
                if end > pos:
                    fi = self._chunk_file[c]
                    lo, hi, dest = pos - chunk_start, end - chunk_start, dest_all[pos - start : end - start]
                    if files[fi].format != "bin":
                        if c != self._last_key:  # neighbouring windows mostly share a chunk: skip the LRU for them
                            self._last_chunk, self._last_key = self._chunk(c), c
                        values, offsets = self._last_chunk
                        dest[:] = values[lo:hi] if eos is None else stream_slice(values, offsets, eos, lo, hi)
                    elif self.store.local is not None:
                        dest[:] = self._handle(fi)[lo:hi]
                    else:
                        remote[fi].append((lo, hi, dest))
                pos = end
                c += 1
        for fi, pieces in remote.items():
            self._fetch_bin(fi, pieces)
        return out

    def _fetch_bin(self, fi: int, pieces: list) -> None:
        f = self.index.files[fi]
        bufs = [np.empty(hi - lo, dtype=self.dtype) for lo, hi, _ in pieces]
        got = self.store.read_into(f.rel, [(lo * self.dtype.itemsize, [buf]) for (lo, _, _), buf in zip(pieces, bufs)])
        for n, buf, (_, _, dest) in zip(got, bufs, pieces):
            if n != buf.nbytes:
                raise ValueError(f"{self.store.describe(f.rel)} is shorter than when the job indexed it ({f.size} bytes): the corpus changed")
            dest[:] = buf
            self.bytes_fetched += n

    def _handle(self, fi: int):
        """The open form of file `fi`: a memory map (.bin), a ParquetFile, or Arrow batches; the least recently used closes."""
        handle = self._open.get(fi)
        if handle is not None:
            self._open.move_to_end(fi)
            return handle
        f = self.index.files[fi]
        if f.format == "bin":
            size = os.stat(self.store.local / f.rel).st_size
            if size != f.size:
                raise ValueError(f"{self.store.describe(f.rel)} has {size} bytes, {f.size} when the job indexed it: the corpus changed")
            handle = np.memmap(self.store.local / f.rel, dtype=self.dtype, mode="r").view(np.ndarray)  # slices without memmap's overhead
        elif f.format == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(_open_arrow(self.store, f.rel))
            handle = (pf, _parquet_leaf(pf.metadata, self.cfg.column))
        else:
            handle = _ArrowBatches(self.store, f.rel)
        self._open[fi] = handle
        while len(self._open) > OPEN_FILES:
            self._open.popitem(last=False)
        return handle

    def _chunk(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk `c` (in stream order) as (token values, document offsets), from the LRU or decoded into it."""
        fi, ci = self._chunk_file[c], self._chunk_local[c]
        cached = self.cache.get((fi, ci))
        if cached is not None:
            return cached[0]
        if self.store.local is not None:
            ((values, offsets, fetched),) = self._decode_chunks(fi, [ci], self._handle(fi))
        else:
            sequential = c == self._last_miss + 1  # the second neighbour in a row: a pass in stream order
            self.read_ahead_used += c in self._ahead
            if sequential and c not in self._ahead:
                self._read_ahead(c - 1)  # this chunk and the ones after it, in one read
            future, i = self._ahead.pop(c, None) or (self._fetch(fi, [ci]), 0)
            values, offsets, fetched = future.result()[i]
            if sequential:
                self._read_ahead(c)
            self._last_miss = c
        self.bytes_fetched += fetched
        self.cache.put((fi, ci), (values, offsets), values.nbytes + offsets.nbytes)
        return values, offsets

    def _fetch(self, fi: int, cis: list[int]) -> Future:
        """Read and decode chunks `cis` of remote file `fi` on the fetch thread."""
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokens-fetch")
        return self._fetcher.submit(self._decode_chunks, fi, cis, self._handle(fi))

    def _read_ahead(self, c: int) -> None:
        """Keep the chunks after `c` in flight: up to `READ_AHEAD` of them and a quarter of the cache (at 8 bytes a token).

        It asks again once half of them have been taken, each file's chunks in
        one read: a Parquet file's neighbouring row groups then come in one
        coalesced request, not one request each.
        """
        window, budget = [], self.cache.max_bytes // 32  # tokens
        for nxt in range(c + 1, min(c + 1 + READ_AHEAD, len(self._chunk_file))):
            fi = self._chunk_file[nxt]
            budget -= self.index.files[fi].chunks[self._chunk_local[nxt]]
            if budget < 0 and window:
                break
            if self.index.files[fi].format != "bin":
                window.append(nxt)
        wanted = [n for n in window if n not in self._ahead and (self._chunk_file[n], self._chunk_local[n]) not in self.cache]
        if not wanted or 2 * len(wanted) < len(window):
            return
        for fi, group in groupby(wanted, key=self._chunk_file.__getitem__):
            group = list(group)
            future = self._fetch(fi, [self._chunk_local[n] for n in group])
            self._ahead.update((n, (future, i)) for i, n in enumerate(group))

    def _decode_chunks(self, fi: int, cis: list[int], handle) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """(token values, document offsets, bytes it cost) of chunks `cis` of file `fi`, read through its open `handle`."""
        f = self.index.files[fi]
        if f.format == "parquet":
            pf, leaf = handle
            column = pf.read_row_groups(cis, columns=[self.cfg.column]).column(0)  # neighbouring row groups: one coalesced read
            rows = np.cumsum([0] + [pf.metadata.row_group(ci).num_rows for ci in cis]).tolist()
            pieces = [(column.slice(rows[i], rows[i + 1] - rows[i]), pf.metadata.row_group(ci).column(leaf).total_compressed_size)
                      for i, ci in enumerate(cis)]
        else:
            batches = [handle.get(ci) for ci in cis]
            pieces = [(b.column(self.cfg.column), b.nbytes if self.store.local is None else 0) for b in batches]
        out = []
        for ci, (array, fetched) in zip(cis, pieces):
            where = f"{self.store.describe(f.rel)} chunk {ci}"
            values, offsets = _decode(array, where)
            tokens = len(values) + (len(offsets) - 1 if self.cfg.eos_token is not None else 0)
            if tokens != f.chunks[ci]:
                raise ValueError(f"{where} has {tokens} tokens, {f.chunks[ci]} when the job indexed it: the corpus changed")
            out.append((values, offsets, fetched))
        return out


class TokenWindows:
    """Windows [first, first + count) of a corpus as a dataset: index -> seq_len + 1 tokens."""

    def __init__(self, reader: TokenReader, seq_len: int, first: int, count: int):
        self.reader, self.seq_len, self.first, self.count = reader, seq_len, first, count

    def __len__(self) -> int:
        return self.count

    def windows(self, indices: list[int]) -> np.ndarray:
        """The windows of these sample indices, (len(indices), seq_len + 1) int64."""
        L = self.seq_len
        if indices and not (0 <= min(indices) and max(indices) < self.count):
            raise IndexError(f"samples {min(indices)}..{max(indices)} outside [0, {self.count})")
        ranges = [((self.first + i) * L, (self.first + i) * L + L + 1) for i in indices]
        rows = np.empty((len(indices), L + 1), dtype=np.int64)
        self.reader.read(ranges, out=list(rows))
        return rows

    def batch(self, indices: list[int]):
        """Inputs and next-token labels for these sample indices, each (len(indices), seq_len)."""
        import torch

        full = torch.from_numpy(self.windows(indices))
        return full[:, :-1].contiguous(), full[:, 1:].contiguous()
