"""Loading at any layout: each rank reads only the pieces that overlap its own shards.

Planning is local and cheap: the rank computes the global boxes its local
shards cover (strided FSDP-over-TP shards included), looks each box up in a
per-key `PieceIndex` (bisect, not all pairs), and groups the pieces it needs
by file. Adjacent byte ranges are coalesced into one scatter read (up to
`COALESCE_MAX`) that puts whole pieces straight into their destination where
it is contiguous; `READERS` threads run these reads concurrently, across and
within files, and each checksums what it read while the others wait on the
disk (CRC-32 releases the GIL). Every piece's CRC-32 is checked before the
load returns.

`ReadPlanner` decodes a checkpoint's index once and plans any number of
ranks: keys whose pieces share a geometry (a parameter and its optimizer
state, every layer's `wq`) share one lookup structure and its answers, which
is what makes planning all ranks of a 512-rank load take well under a second
in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from storage.boxes import Box, PieceIndex
from storage.catalog import _manifest, read_index, unreadable
from storage.format import ALIGN, CheckpointError, Piece, crc32, step_dir
from storage.fs import Store
from storage.state import DTYPES, local_view, state_tensors, tensor_boxes

COALESCE_GAP = 1 << 20
"""Ranges of one file closer than this are read as one (the gap is read and dropped)."""
COALESCE_MAX = 16 << 20
"""A coalesced read stays under this size (unless one piece is larger), so that a file's reads spread over the readers."""
READERS = 4
"""Reads of local files in flight at once per load (the disk queue stays busy; checksums run while other reads wait)."""


@dataclass
class _Need:
    """One stored piece and the local regions it fills."""

    piece: Piece
    copies: list[tuple[str, int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    # (key, index of the local box, overlap offsets, overlap lengths)


Target = tuple[tuple[int, ...], torch.Tensor, list[Box]]
"""What a loading rank fills of one tensor: (global shape, local tensor, the boxes of the global tensor it holds)."""


class ReadPlanner:
    """A committed checkpoint's index, decoded and bucketed once: plans the reads of any number of loading ranks.

    One process can plan every rank of a large job with it (and `load_shards`
    uses one per load): a rank's plan is its local boxes looked up per key in a
    `PieceIndex`, the pieces grouped by data file in byte order, and adjacent
    ranges coalesced into single reads. Planning touches no tensor data.
    """

    def __init__(self, pieces: list[Piece], where: str, manifest: dict | None = None):
        self.where = where
        self.manifest = manifest
        by_key: dict[str, list[Piece]] = {}
        for p in pieces:
            by_key.setdefault(p.key, []).append(p)
        # Keys whose pieces have the same boxes (a parameter and its optimizer state, every layer's `wq`)
        # share one geometry: its PieceIndex and the answers to its queries are computed once.
        self._pieces: dict[str, list[Piece]] = {}
        self._geometry: dict[str, int] = {}
        shapes: dict[tuple, int] = {}
        self._indexes: list[PieceIndex] = []
        for key, stored in by_key.items():
            stored.sort(key=lambda p: p.offsets)
            self._pieces[key] = stored
            signature = tuple((p.offsets, p.lengths) for p in stored)
            gid = shapes.get(signature)
            if gid is None:
                gid = shapes[signature] = len(self._indexes)
                self._indexes.append(PieceIndex([(p.offsets, p.lengths, j) for j, p in enumerate(stored)]))
            self._geometry[key] = gid
        self._answers: dict[tuple, list] = {}

    @classmethod
    def open(cls, uri: str, step: int, *, storage_options: dict | None = None) -> ReadPlanner:
        """Read, check and decode the manifest and index of a committed checkpoint."""
        store = Store(uri, storage_options)
        manifest = _manifest(store, step)
        return cls(read_index(store, step, manifest), store.describe(step_dir(step)), manifest)

    def keys(self) -> list[str]:
        return sorted(self._pieces)

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(global shape, dtype) of a stored tensor."""
        stored = self._pieces.get(key)
        if not stored:
            raise CheckpointError(f"{self.where}: the checkpoint has no tensor {key!r}")
        return stored[0].shape, DTYPES[stored[0].dtype]

    def _overlaps(self, key: str, box: Box) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """(position among the key's pieces, overlap offsets, overlap lengths) of every stored piece the box overlaps."""
        memo = (self._geometry[key], box.offsets, box.lengths)
        hits = self._answers.get(memo)
        if hits is None:
            hits = self._answers[memo] = list(self._indexes[memo[0]].overlapping(box.offsets, box.lengths))
        return hits

    def plan(self, wants: dict[str, tuple[tuple[int, ...], torch.dtype, list[Box]]]) -> dict[str, list[list[_Need]]]:
        """The reads of one rank: {file: coalesced groups of pieces in byte order}.

        `wants` maps each key to (global shape, dtype, local boxes); every key
        must exist in the checkpoint with that shape and dtype.
        """
        needs: dict[tuple[str, int], _Need] = {}
        for key, (shape, dtype, boxes) in wants.items():
            stored_shape, stored_dtype = self.meta(key)
            if tuple(shape) != stored_shape or dtype != stored_dtype:
                raise CheckpointError(
                    f"{self.where}: {key!r} is {str(stored_dtype).removeprefix('torch.')}{list(stored_shape)} in the "
                    f"checkpoint, {str(dtype).removeprefix('torch.')}{list(shape)} here"
                )
            if not boxes:
                continue
            stored = self._pieces[key]
            for i, box in enumerate(boxes):
                for j, offs, lens in self._overlaps(key, box):
                    p = stored[j]
                    need = needs.get((p.file, p.byte_offset))
                    if need is None:
                        need = needs[(p.file, p.byte_offset)] = _Need(p)
                    need.copies.append((key, i, offs, lens))
        by_file: dict[str, list[_Need]] = {}
        for need in needs.values():
            by_file.setdefault(need.piece.file, []).append(need)
        out = {}
        for rel in sorted(by_file):
            file_needs = by_file[rel]
            file_needs.sort(key=lambda n: n.piece.byte_offset)
            out[rel] = _coalesce(file_needs)
        return out


def _coalesce(needs: list[_Need]) -> list[list[_Need]]:
    """Group pieces (in byte order) into reads: gaps up to COALESCE_GAP are read through, a read stays under COALESCE_MAX."""
    groups: list[list[_Need]] = []
    for need in needs:
        if groups:
            first, last = groups[-1][0].piece, groups[-1][-1].piece
            end = need.piece.byte_offset + need.piece.nbytes
            if need.piece.byte_offset - (last.byte_offset + last.nbytes) <= COALESCE_GAP and end - first.byte_offset <= COALESCE_MAX:
                groups[-1].append(need)
                continue
        groups.append([need])
    return groups


def _piece_ranges(groups: list[list[_Need]]) -> list[tuple[int, int]]:
    """The bytes [start, end) of a file's pieces that a load reads, runs of pieces apart by no more than their
    alignment merged: what a read needs to be there (the gaps a coalesced read spans are read and dropped)."""
    out: list[list[int]] = []
    for group in groups:
        for need in group:
            start, end = need.piece.byte_offset, need.piece.byte_offset + need.piece.nbytes
            if out and start - out[-1][1] < ALIGN:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
    return [(a, b) for a, b in out]


def _views(need: _Need, targets: dict[str, tuple[torch.Tensor, list[Box]]]):
    """(overlap offsets, overlap lengths, destination view) for every region of the local tensors a piece fills."""
    for key, i, offs, lens in need.copies:
        local, boxes = targets[key]
        box = boxes[i]
        view = local_view(local, box)
        for d, (o, n) in enumerate(zip(offs, lens)):
            view = view.narrow(d, o - box.offsets[d], n)
        yield offs, lens, view


def _direct_target(need: _Need, targets):
    """The destination's bytes when the piece lands whole in one contiguous CPU region: read straight into it."""
    if len(need.copies) != 1:
        return None
    offs, lens, dest = next(_views(need, targets))
    p = need.piece
    if (offs, lens) != (p.offsets, p.lengths) or dest.device.type != "cpu" or not dest.is_contiguous():
        return None
    return dest.detach().reshape(-1).view(torch.uint8).numpy()


def _buffers(group: list[_Need], targets):
    """The scatter list of one coalesced read (gaps read into scratch) and, per piece, (need, buffer, read in place)."""
    pos = group[0].piece.byte_offset
    buffers, checks = [], []
    for need in group:
        p = need.piece
        if p.byte_offset > pos:
            buffers.append(bytearray(p.byte_offset - pos))
        direct = _direct_target(need, targets)
        buf = direct if direct is not None else torch.empty(p.nbytes, dtype=torch.uint8).numpy()
        buffers.append(buf)
        checks.append((need, buf, direct is not None))
        pos = p.byte_offset + p.nbytes
    return buffers, checks


def _read_group(store: Store, path: str, group: list[_Need], targets) -> None:
    """One coalesced read of a local file, whole pieces straight into place, then each piece checked (and copied)."""
    name = store.describe(path)
    start, end = group[0].piece.byte_offset, group[-1].piece.byte_offset + group[-1].piece.nbytes
    buffers, checks = _buffers(group, targets)
    try:
        got = store.read_into(path, [(start, buffers)])[0]
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing") from None
    except OSError as exc:
        raise unreadable(name, exc) from None
    if got != end - start:
        raise CheckpointError(f"{name} is truncated: it ends before byte {end}")
    _check_and_place(checks, name, targets)


def _load_object(store: Store, step: int, rel: str, groups: list[list[_Need]], targets) -> None:
    """The pieces of one file on an object store: one concurrent multi-range request, then each piece checked."""
    path = f"{step_dir(step)}/{rel}"
    name = store.describe(path)
    requests = []
    for group in groups:
        buffers, checks = _buffers(group, targets)
        requests.append((group[0].piece.byte_offset, buffers, group[-1].piece.byte_offset + group[-1].piece.nbytes, checks))
    try:
        got = store.read_into(path, [(start, buffers) for start, buffers, _, _ in requests])
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing") from None
    except OSError as exc:
        raise unreadable(name, exc) from None
    for (start, _, end, _), n in zip(requests, got):
        if n != end - start:
            raise CheckpointError(f"{name} is truncated: it ends before byte {end}")
    for request in requests:
        _check_and_place(request[3], name, targets)


def _check_and_place(checks, name: str, targets) -> None:
    for need, buf, direct in checks:
        p = need.piece
        if crc32(buf) != p.crc32:
            raise CheckpointError(
                f"{name}: piece {p.key!r} at {list(p.offsets)} (bytes {p.byte_offset}..{p.byte_offset + p.nbytes}) "
                "fails its checksum (corrupted data)"
            )
        if direct:
            continue
        src = torch.from_numpy(buf).view(DTYPES[p.dtype]).view(p.lengths)
        for offs, lens, dest in _views(need, targets):
            view = src
            for d, (o, n) in enumerate(zip(offs, lens)):
                view = view.narrow(d, o - p.offsets[d], n)
            with torch.no_grad():
                dest.copy_(view)


BeforeRead = Callable[[dict[str, list[tuple[int, int]]]], None]
"""Called with what a load reads, before it reads any: {data file (its name in the step's directory): [(start, end)
byte ranges, in order]}."""


def load_into(
    uri: str, step: int, targets: dict[str, Target], *, planner: ReadPlanner | None = None, storage_options: dict | None = None,
    before_read: BeforeRead | None = None,
) -> dict:
    """Fill local tensors given by their boxes: {key: (global shape, local tensor, boxes)}; returns the manifest.

    The tensors need not be DTensors: this is how one process plays any rank of
    any layout (scale simulations), and what `load_shards` does with a
    template's DTensors. Pass a `planner` (`ReadPlanner.open`) to decode the
    index once for many loads of the same checkpoint. `before_read` learns
    the byte ranges of the files that this load reads before it reads any: a
    restore from node memory fetches those its node lacks, and no others.
    """
    store = Store(uri, storage_options)
    if planner is None:
        planner = ReadPlanner.open(uri, step, storage_options=storage_options)
    plan = planner.plan({key: (shape, local.dtype, boxes) for key, (shape, local, boxes) in targets.items()})
    if before_read is not None:
        before_read({rel: _piece_ranges(groups) for rel, groups in plan.items()})
    # Detached: the loads write in place into views taken later, which autograd would forbid on a parameter's to_local().
    places = {key: (local.detach(), boxes) for key, (_, local, boxes) in targets.items()}
    if store.local is None:
        jobs = [(_load_object, (store, step, rel, groups, places)) for rel, groups in plan.items()]
        workers = 8
    else:  # every coalesced read is a job: several reads in flight, each checksummed by the thread that read it
        jobs = [(_read_group, (store, f"{step_dir(step)}/{rel}", group, places)) for rel, groups in plan.items() for group in groups]
        workers = READERS
    if jobs:
        with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="ckpt-read") as pool:
            futures = [pool.submit(fn, *args) for fn, args in jobs]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    return planner.manifest


def load_shards(
    uri: str, step: int, template: dict[str, torch.Tensor], *, storage_options: dict | None = None, before_read: BeforeRead | None = None,
) -> dict:
    """Fill every tensor of `template` (plain or DTensor, any layout) in place from a committed checkpoint.

    Returns the manifest (its `train_state` restores the rest of the job). On a
    CheckpointError the template's contents are undefined: pieces are read
    straight into place and checked there.
    """
    targets = {}
    for key, t in template.items():
        local, boxes = tensor_boxes(t)
        targets[key] = (tuple(t.shape), local, boxes)
    return load_into(uri, step, targets, storage_options=storage_options, before_read=before_read)


def load_training_state(
    uri: str, step: int, model_parts, optimizer=None, *, storage_options: dict | None = None, before_read: BeforeRead | None = None,
) -> dict:
    """Load parameters and optimizer state of `model_parts` (any layout) in place; returns the manifest.

    The optimizer then continues bitwise as the saved one would have, given
    the same learning rate (the scheduler lives in the manifest's `train_state`).
    """
    return load_shards(uri, step, state_tensors(model_parts, optimizer), storage_options=storage_options, before_read=before_read)
