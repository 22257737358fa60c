"""Box arithmetic: where a local shard sits in its global tensor, and which stored pieces overlap it.

A *box* is a dense sub-block of a global tensor: per-dimension offsets and
lengths. A DTensor's local shard is a union of boxes: with `Shard` placements
it is one box; with `_StridedShard` (FSDP over TP) each rank's rows along a
dimension can be several runs, and the local tensor is their product.

Everything here is pure integer arithmetic on run lists, mirroring torch's
placement semantics (`torch.chunk` sizes, placements applied left to right over
the mesh dimensions, `_StridedShard` splitting each of `split_factor` chunks)
without touching a process group, so any rank of any layout can be planned in
one process. `PieceIndex` answers "which stored pieces overlap this box" by
bisecting pieces sorted along one dimension instead of comparing all pairs.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Shard, _StridedShard

Run = tuple[int, int]  # (global start, length), listed in local order


@dataclass(frozen=True)
class Box:
    """A dense block: `lengths` elements per dim starting at `offsets` (global), stored at `local` in the local tensor."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    local: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for length in self.lengths:
            n *= length
        return n


def chunk_bounds(size: int, chunks: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk `index` when `size` elements are split like `torch.chunk` (empty chunks at the end)."""
    step = -(-size // chunks)
    return min(index * step, size), min((index + 1) * step, size)


def _take(runs: list[Run], start: int, stop: int) -> list[Run]:
    """Positions [start, stop) of the sequence that `runs` describes."""
    out: list[Run] = []
    pos = 0
    for g, n in runs:
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            out.append((g + lo - pos, hi - lo))
        pos += n
        if pos >= stop:
            break
    return out


def _merge(runs: list[Run]) -> list[Run]:
    out: list[Run] = []
    for g, n in runs:
        if out and out[-1][0] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((g, n))
    return out


def shard_runs(runs: list[Run], chunks: int, index: int, split_factor: int = 1) -> list[Run]:
    """The part of `runs` that mesh coordinate `index` of `chunks` keeps.

    `split_factor == 1` is `Shard`; otherwise `_StridedShard`: the sequence is cut
    into `split_factor` chunks, each of those into `chunks`, and the coordinate
    keeps its piece of every one of them, in order.
    """
    length = sum(n for _, n in runs)
    out: list[Run] = []
    for j in range(split_factor):
        a, b = chunk_bounds(length, split_factor, j)
        c0, c1 = chunk_bounds(b - a, chunks, index)
        out.extend(_take(runs, a + c0, a + c1))
    return _merge(out)


def local_runs(global_shape: Sequence[int], mesh_shape: Sequence[int], coords: Sequence[int], placements) -> list[list[Run]]:
    """Per dimension, the runs of global indices a mesh coordinate holds, in local order (the local shape is their sums)."""
    runs: list[list[Run]] = [[(0, size)] if size else [] for size in global_shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            split = int(placement.split_factor)
        elif isinstance(placement, Shard):
            split = 1
        else:
            continue
        runs[placement.dim] = shard_runs(runs[placement.dim], mesh_shape[mesh_dim], coords[mesh_dim], split)
    return runs


def local_boxes(global_shape: Sequence[int], mesh_shape: Sequence[int], coords: Sequence[int], placements) -> list[Box]:
    """The boxes of the global tensor that a mesh coordinate holds, with their place in its local tensor.

    `placements` are torch placements: `Shard`, `_StridedShard` cut a dimension,
    `Replicate`/`Partial` leave it whole. An empty local shard gives no boxes.
    """
    return list(_local_boxes(tuple(global_shape), tuple(mesh_shape), tuple(coords), _placement_keys(tuple(placements))))


@functools.lru_cache(maxsize=1024)
def _placement_keys(placements: tuple) -> tuple:
    return tuple(_placement_key(p) for p in placements)


def _placement_key(placement) -> tuple:
    if isinstance(placement, _StridedShard):
        return (placement.dim, int(placement.split_factor))
    if isinstance(placement, Shard):
        return (placement.dim, 1)
    return ()


@functools.lru_cache(maxsize=1 << 16)
def _local_boxes(global_shape: tuple, mesh_shape: tuple, coords: tuple, placements: tuple) -> tuple[Box, ...]:
    """`local_boxes` on hashable arguments, memoised: tensors of one shape and placement (every layer's `wq`,
    a parameter and its optimizer state) and replicas share the result, which makes planning many ranks cheap."""
    runs: list[list[Run]] = [[(0, size)] if size else [] for size in global_shape]
    for mesh_dim, p in enumerate(placements):
        if p:
            runs[p[0]] = shard_runs(runs[p[0]], mesh_shape[mesh_dim], coords[mesh_dim], p[1])
    if any(not r for r in runs):
        return ()
    per_dim = []
    for dim_runs in runs:
        pos, entries = 0, []
        for g, n in dim_runs:
            entries.append((g, n, pos))
            pos += n
        per_dim.append(entries)
    return tuple(
        Box(tuple(e[0] for e in combo), tuple(e[1] for e in combo), tuple(e[2] for e in combo))
        for combo in itertools.product(*per_dim)
    )


def intersect(a_off: Sequence[int], a_len: Sequence[int], b_off: Sequence[int], b_len: Sequence[int]):
    """(offsets, lengths) of the overlap of two boxes, or None when they do not overlap."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a_off, a_len, b_off, b_len):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if lo >= hi:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return tuple(offs), tuple(lens)


def split_rows(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    """Cut a box along its first dimension into blocks of at most `max_bytes` (at least one row each).

    Smaller stored pieces bound the read amplification of a reshard: a loader
    reads whole pieces (their checksum covers the whole piece).
    """
    row_bytes = itemsize
    for length in box.lengths[1:]:
        row_bytes *= length
    if not box.lengths or box.lengths[0] * row_bytes <= max_bytes:
        return [box]
    rows = max(1, max_bytes // row_bytes)
    out = []
    for start in range(0, box.lengths[0], rows):
        n = min(rows, box.lengths[0] - start)
        out.append(
            Box(
                (box.offsets[0] + start, *box.offsets[1:]),
                (n, *box.lengths[1:]),
                (box.local[0] + start, *box.local[1:]),
            )
        )
    return out


class PieceIndex:
    """The stored pieces of one tensor, searchable by box.

    Pieces are sorted by their start along the dimension where they differ the
    most; a query bisects that order, scans only pieces whose start lies within
    one maximal piece length before the query's end, and checks the full box
    only for those: O(log n + hits) per query instead of O(n).
    """

    def __init__(self, pieces: Sequence[tuple[Sequence[int], Sequence[int], object]]):
        """`pieces`: (offsets, lengths, payload) per stored piece."""
        ndim = len(pieces[0][0]) if pieces else 0
        self.dim = 0
        if ndim:
            self.dim = max(range(ndim), key=lambda d: len({p[0][d] for p in pieces}))
        d = self.dim
        self.pieces = sorted(pieces, key=lambda p: tuple(p[0][d:d + 1]))
        self.starts = [p[0][d] if ndim else 0 for p in self.pieces]
        self.max_len = max((p[1][d] for p in self.pieces), default=0) if ndim else 1

    def overlapping(self, offsets: Sequence[int], lengths: Sequence[int]):
        """Yield (payload, overlap offsets, overlap lengths) for every stored piece overlapping the box."""
        if not offsets:  # a scalar: every piece is the whole tensor
            for p in self.pieces:
                yield p[2], (), ()
            return
        d = self.dim
        lo = bisect.bisect_right(self.starts, offsets[d] - self.max_len)
        hi = bisect.bisect_left(self.starts, offsets[d] + lengths[d])
        for p in self.pieces[lo:hi]:
            hit = intersect(offsets, lengths, p[0], p[1])
            if hit is not None:
                yield p[2], hit[0], hit[1]
