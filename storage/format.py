"""The on-disk format: names, the Arrow index, the manifest, and their validation.

    <root>/step_00000040/data/g000002-rank_00003.bin   raw bytes, pieces back to back
    <root>/step_00000040/index.arrow                    Arrow IPC, one row per piece
    <root>/step_00000040/manifest.json                  written last: the commit

A data file's name carries the generation of the job that wrote it (`g000002`)
and the writing rank, so a late write of an earlier generation lands in a file
of its own and can never overwrite the file the next generation wrote for the
same step; a commit lists only files of the committing generation. Checkpoints
of the first format, with `data/rank_00003.bin`, still load and verify.

Trust flows from the manifest down: it records the size and CRC-32 of the
index and of every data file; the index records each piece's key, dtype,
global shape, global offsets and lengths, file, byte range and CRC-32. A
reader checks each link before it follows it, so every problem is reported as
a `CheckpointError` that names the file. Nothing here can execute code: JSON,
Arrow IPC and raw little-endian bytes with a dtype from a fixed table.
"""

from __future__ import annotations

import ctypes
import json
import re
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    import torch

FORMAT = "elastic-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.arrow"
ALIGN = 64
"""Pieces start at multiples of this many bytes in their data file (zero padding between), so a read buffer views any dtype aligned."""
_STEP_DIR = re.compile(r"step_([0-9]{8,})")
_DATA_FILE = re.compile(r"data/(?:g(?P<generation>[0-9]{6,})-)?rank_[0-9]{5,}\.bin")
"""The only names a data file may have (matched whole): inside the step directory, no `..`, no absolute path."""
DATA_FILE_FORM = "data/gGGGGGG-rank_NNNNN.bin"

DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex64": 8, "complex128": 16, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
"""The dtypes a checkpoint stores, by torch's names, and their bytes per element (`storage.state.DTYPES` maps them
to torch's dtypes). This module does not import torch: the node agent reads, writes and commits this format without
it (`elastic.agent`)."""

INDEX_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("dtype", pa.string()),
        ("shape", pa.list_(pa.int64())),
        ("offsets", pa.list_(pa.int64())),
        ("lengths", pa.list_(pa.int64())),
        ("file", pa.string()),
        ("byte_offset", pa.int64()),
        ("nbytes", pa.int64()),
        ("crc32", pa.uint32()),
    ]
)
INDEX_COLUMNS = tuple(INDEX_SCHEMA.names)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file and the problem."""


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def data_file(rank: int, generation: int) -> str:
    """The data file `rank` of `generation` writes (relative to the step directory)."""
    for what, n in (("rank", rank), ("generation", generation)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"data_file: {what} must be a non-negative int, not {n!r}")
    return f"data/g{generation:06d}-rank_{rank:05d}.bin"


def data_file_generation(name: str) -> int | None:
    """The generation that wrote a data file, from its name; None for a first-format name or anything else."""
    m = _DATA_FILE.fullmatch(name)
    return int(m.group("generation")) if m and m.group("generation") is not None else None


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise CheckpointError(f"dtype {dtype} cannot be stored")
    return name


def align_up(pos: int) -> int:
    return -(-pos // ALIGN) * ALIGN


try:  # ISA-L's CRC-32: the same checksum as zlib's, about 4x as fast here (9 GB/s against 2.3), and GIL-free too
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a platform without its wheel: zlib's
    _crc32 = zlib.crc32


def crc32(buf, value: int = 0) -> int:
    """CRC-32 as zlib computes it (ISA-L's where installed); releases the GIL on large buffers.

    On a memory snapshot every step the checksum was the largest part of the
    rank's CPU (a third of it on the strategies benchmark's model)."""
    return _crc32(buf, value)


_CRC_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (reflected bit order), as zlib's `multmodp`."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A+B from crc32(A), crc32(B) and len(B), without the bytes (zlib's `crc32_combine`).

    A save computes each piece's checksum once and derives the whole file's
    from them, instead of a second pass over the data. zlib's own function
    (through ctypes) costs about 1 us a call, the Python one about 65 us.
    """
    if _ZLIB_COMBINE is not None:
        return _ZLIB_COMBINE(crc1, crc2, len2) & 0xFFFFFFFF
    return crc32_combine_py(crc1, crc2, len2)


def crc32_combine_py(crc1: int, crc2: int, len2: int) -> int:
    """`crc32_combine` in Python, where zlib's shared library cannot be loaded."""
    p, n, k = 1 << 31, len2, 3  # x^0; x^(8 * len2) is built from x^(2^k), k >= 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ (crc2 & 0xFFFFFFFF)


def _load_zlib_combine():
    for name in ("libz.so.1", "libz.dylib", "zlib1.dll"):
        try:
            fn = ctypes.CDLL(name).crc32_combine
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_ulong, [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_long]
        return fn
    return None


_ZLIB_COMBINE = _load_zlib_combine()
COMBINE_IS_CHEAP = _ZLIB_COMBINE is not None
"""Whether `crc32_combine` is zlib's (cheaper than a second CRC pass over any piece)."""


# -- index -----------------------------------------------------------------------
def encode_index(rows: list[dict]) -> bytes:
    """Rows (dicts with INDEX_COLUMNS) as an Arrow IPC file, sorted by key and offsets."""
    rows = sorted(rows, key=lambda r: (r["key"], list(r["offsets"])))
    table = pa.Table.from_pydict({name: [r[name] for r in rows] for name in INDEX_COLUMNS}, schema=INDEX_SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, INDEX_SCHEMA) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


@dataclass(frozen=True)
class Piece:
    """One stored piece, validated against the manifest."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: str
    byte_offset: int
    nbytes: int
    crc32: int

    @classmethod
    def from_row(cls, row: dict) -> Piece:
        return cls(**{k: tuple(row[k]) if k in ("shape", "offsets", "lengths") else row[k] for k in INDEX_COLUMNS})


def decode_index(data: bytes, files: dict[str, dict], where: str) -> list[Piece]:
    """Parse and check the index: every row must point inside a data file the manifest lists."""
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        # The IPC reader checks little of the buffers: offsets that run backwards or past their data, strings that
        # are not UTF-8 would crash the conversion below or read outside the buffer. Untrusted input: check it all.
        table.validate(full=True)
    except (pa.ArrowException, OSError) as exc:
        raise CheckpointError(f"{where}: {INDEX} is not a readable Arrow file ({exc})") from None
    if not table.schema.remove_metadata().equals(INDEX_SCHEMA):
        raise CheckpointError(f"{where}: {INDEX} has the schema {table.schema}, expected {INDEX_SCHEMA}")
    for name in INDEX_COLUMNS:
        if table.column(name).null_count:
            raise CheckpointError(f"{where}: {INDEX} has missing values in column {name!r}")
    cols = {name: table.column(name).to_pylist() for name in INDEX_COLUMNS}
    pieces = []
    for i in range(table.num_rows):
        p = Piece.from_row({name: cols[name][i] for name in INDEX_COLUMNS})
        _check_piece(p, i, files, where)
        pieces.append(p)
    return pieces


def _check_piece(p: Piece, i: int, files: dict[str, dict], where: str) -> None:
    what = f"{where}/{INDEX}: row {i} ({p.key!r})"
    if p.file not in files or not _DATA_FILE.fullmatch(p.file):
        raise CheckpointError(f"{what} points to {p.file!r}, outside the checkpoint's data files")
    if p.dtype not in DTYPE_SIZES:
        raise CheckpointError(f"{what} has unknown dtype {p.dtype!r}")
    if not (len(p.shape) == len(p.offsets) == len(p.lengths)) or any(
        o < 0 or n < 1 or o + n > s for o, n, s in zip(p.offsets, p.lengths, p.shape)
    ):
        raise CheckpointError(f"{what} has a box {p.offsets}+{p.lengths} outside its shape {p.shape}")
    numel = 1
    for n in p.lengths:
        numel *= n
    if p.nbytes != numel * DTYPE_SIZES[p.dtype]:
        raise CheckpointError(f"{what} has {p.nbytes} bytes for {numel} elements of {p.dtype}")
    if p.byte_offset < 0 or p.byte_offset + p.nbytes > files[p.file]["bytes"]:
        raise CheckpointError(
            f"{what} points to bytes [{p.byte_offset}, {p.byte_offset + p.nbytes}) outside {p.file} "
            f"({files[p.file]['bytes']} bytes)"
        )


def check_coverage(pieces, where: str) -> dict[str, dict]:
    """Every tensor must be covered exactly by its pieces, with one dtype and shape; returns {key: {dtype, shape}}."""
    tensors: dict[str, dict] = {}
    covered: dict[str, int] = {}
    for p in pieces:
        meta = tensors.setdefault(p.key, {"dtype": p.dtype, "shape": list(p.shape)})
        if meta != {"dtype": p.dtype, "shape": list(p.shape)}:
            raise CheckpointError(f"{where}: pieces of {p.key!r} disagree on dtype/shape ({meta} vs {p.dtype} {list(p.shape)})")
        n = 1
        for length in p.lengths:
            n *= length
        covered[p.key] = covered.get(p.key, 0) + n
    for key, meta in tensors.items():
        total = 1
        for s in meta["shape"]:
            total *= s
        if covered[key] != total:
            raise CheckpointError(f"{where}: the pieces of {key!r} cover {covered[key]} of its {total} elements")
    return tensors


# -- manifest --------------------------------------------------------------------
def encode_manifest(manifest: dict) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def decode_manifest(data: bytes, step: int, where: str) -> dict:
    """Parse and check a manifest; anything unexpected is a CheckpointError naming the file."""
    what = f"{where}/{MANIFEST}"
    try:
        m = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{what} is garbled: {exc}") from None
    except RecursionError:
        raise CheckpointError(f"{what} is garbled: nested too deeply") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{what} is garbled: not an {FORMAT} manifest")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{what} has format version {m.get('version')!r}; this reader knows {VERSION}")
    if m.get("step") != step:
        raise CheckpointError(f"{what} is garbled: it says step {m.get('step')!r}, its directory says {step}")
    files, index = m.get("files"), m.get("index")
    ok = isinstance(files, dict) and isinstance(index, dict) and _file_entry_ok(index)
    ok = ok and all(isinstance(k, str) and _file_entry_ok(v) for k, v in files.items())
    if not ok or not isinstance(m.get("train_state"), dict) or not isinstance(m.get("layout"), dict):
        raise CheckpointError(f"{what} is garbled: missing or malformed files, index, layout or train_state")
    for name in files:  # untrusted: a name like "../../x" must never reach a path
        if not _DATA_FILE.fullmatch(name):
            raise CheckpointError(f"{what} names a data file {name!r} that is not {DATA_FILE_FORM} inside the checkpoint")
    return m


def _file_entry_ok(entry) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("bytes"), int)
        and entry["bytes"] >= 0
        and isinstance(entry.get("crc32"), int)
    )
