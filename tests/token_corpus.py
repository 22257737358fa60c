"""Tiny token corpora for the data tests, and what they must read as, computed here from the documented rules alone.

The rule (`elastic.tokens`): files sorted by path; a Parquet/Arrow row is a
document followed by the EOS token; a .bin file is taken as it is; window i
is tokens [i*L, i*L + L + 1) of the concatenation. The sample order of an
epoch is `np.random.default_rng([seed, 7919, epoch]).permutation(n)`
(`elastic.data.GlobalSampler`); a step digest is the sum over its samples of
CRC-32(labels, CRC-32(inputs)) of the int64 bytes (`elastic.data.batch_digest`).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

EOS = 61
VOCAB = 64


def documents(seed: int, n: int, max_len: int = 23) -> list:
    """Documents of 0..max_len tokens below EOS, one of them null (an empty document)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, EOS, rng.integers(0, max_len)).tolist() for _ in range(n)]
    docs[n // 3] = None
    docs[n // 2] = []
    return docs


def write_corpus(root: Path, kinds=("parquet", "arrow", "bin"), seed: int = 0, docs_per_file: int = 60) -> list[int]:
    """Write one file per kind under `root` (names sort in this order) and return the token stream they make."""
    root.mkdir(parents=True, exist_ok=True)
    stream: list[int] = []
    for i, kind in enumerate(kinds):
        docs = documents(seed + i, docs_per_file)
        table = pa.table({"input_ids": pa.array(docs, pa.list_(pa.int32() if i % 2 else pa.int64())), "text": ["x"] * len(docs)})
        if kind == "parquet":
            pq.write_table(table, root / f"{i:02d}.parquet", row_group_size=7)
        elif kind in ("arrow", "arrow_stream"):
            opener = ipc.new_file if kind == "arrow" else ipc.new_stream
            with opener(root / f"{i:02d}.arrow", table.schema) as writer:
                writer.write_table(table, max_chunksize=11)
        else:
            dtype = np.uint32 if kind == "bin32" else np.uint16
            flat = np.random.default_rng(seed + i).integers(0, VOCAB, 20 * docs_per_file).astype(dtype)
            flat.tofile(root / f"{i:02d}.bin")
            stream += flat.tolist()
            continue
        for doc in docs:
            stream += (doc or []) + [EOS]
    return stream


def windows(stream: list[int], seq_len: int, indices) -> np.ndarray:
    return np.array([stream[i * seq_len : i * seq_len + seq_len + 1] for i in indices], dtype=np.int64)


def order(seed: int, n: int, positions: range) -> list[int]:
    """Sample indices at these positions of the global order."""
    out = []
    for pos in positions:
        epoch, offset = divmod(pos, n)
        out.append(int(np.random.default_rng([seed, 7919, epoch]).permutation(n)[offset]))
    return out


def digest(rows: np.ndarray) -> int:
    return sum(zlib.crc32(r[1:].tobytes(), zlib.crc32(r[:-1].tobytes())) for r in rows.astype(np.int64))
