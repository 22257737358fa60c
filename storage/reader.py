"""Loading at any layout: each rank reads only the pieces that overlap its own shards.

Planning is local and cheap: the rank computes the global boxes its local
shards cover (strided FSDP-over-TP shards included), looks each box up in a
per-key `PieceIndex` (bisect, not all pairs), and groups the pieces it needs
by file. Adjacent byte ranges are coalesced into one scatter read that puts
whole pieces straight into their destination where it is contiguous; files are
read concurrently. Every piece's CRC-32 is checked before the load returns.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from storage.boxes import PieceIndex
from storage.catalog import _manifest, read_index
from storage.format import DTYPES, CheckpointError, Piece, crc32, step_dir
from storage.fs import Store
from storage.state import local_view, state_tensors, tensor_boxes

COALESCE_GAP = 1 << 20
"""Ranges of one file closer than this are read as one (the gap is read and dropped)."""


@dataclass
class _Need:
    """One stored piece and the local regions it fills."""

    piece: Piece
    copies: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]] = field(default_factory=list)
    # (overlap offsets, overlap lengths, destination view of the local tensor)


def plan_reads(pieces: list[Piece], template: dict[str, torch.Tensor], where: str) -> dict[str, list[_Need]]:
    """Which pieces each local box needs, grouped by data file: {file: [_Need sorted by byte offset]}."""
    by_key: dict[str, list[Piece]] = {}
    for p in pieces:
        by_key.setdefault(p.key, []).append(p)
    needs: dict[tuple[str, int], _Need] = {}
    for key, t in template.items():
        stored = by_key.get(key)
        if not stored:
            raise CheckpointError(f"{where}: the checkpoint has no tensor {key!r}")
        first = stored[0]
        if tuple(t.shape) != first.shape or DTYPES[first.dtype] != t.dtype:
            raise CheckpointError(
                f"{where}: {key!r} is {first.dtype}{list(first.shape)} in the checkpoint, {t.dtype}{list(t.shape)} here"
            )
        local, boxes = tensor_boxes(t)
        index = PieceIndex([(p.offsets, p.lengths, p) for p in stored])
        for box in boxes:
            dest = local_view(local, box)
            for p, offs, lens in index.overlapping(box.offsets, box.lengths):
                view = dest
                for d, (o, n) in enumerate(zip(offs, lens)):
                    view = view.narrow(d, o - box.offsets[d], n)
                need = needs.setdefault((p.file, p.byte_offset), _Need(p))
                need.copies.append((offs, lens, view))
    out: dict[str, list[_Need]] = {}
    for need in needs.values():
        out.setdefault(need.piece.file, []).append(need)
    for file_needs in out.values():
        file_needs.sort(key=lambda n: n.piece.byte_offset)
    return out


def _coalesce(needs: list[_Need]) -> list[list[_Need]]:
    groups: list[list[_Need]] = []
    for need in needs:
        if groups:
            last = groups[-1][-1].piece
            if need.piece.byte_offset - (last.byte_offset + last.nbytes) <= COALESCE_GAP:
                groups[-1].append(need)
                continue
        groups.append([need])
    return groups


def _direct_target(need: _Need):
    """The destination's bytes when the piece lands whole in one contiguous CPU region: read straight into it."""
    if len(need.copies) != 1:
        return None
    offs, lens, dest = need.copies[0]
    p = need.piece
    if (offs, lens) != (p.offsets, p.lengths) or dest.device.type != "cpu" or not dest.is_contiguous():
        return None
    return dest.detach().reshape(-1).view(torch.uint8).numpy()


def _load_file(store: Store, step: int, rel: str, needs: list[_Need]) -> None:
    """Read the pieces of one file (coalesced, whole pieces straight into place), check each, copy the rest."""
    requests, targets = [], []
    for group in _coalesce(needs):
        start = pos = group[0].piece.byte_offset
        buffers = []
        for need in group:
            p = need.piece
            if p.byte_offset > pos:
                buffers.append(bytearray(p.byte_offset - pos))
            direct = _direct_target(need)
            buf = direct if direct is not None else torch.empty(p.nbytes, dtype=torch.uint8).numpy()
            buffers.append(buf)
            targets.append((need, buf, direct is not None))
            pos = p.byte_offset + p.nbytes
        requests.append((start, buffers, pos))
    name = store.describe(f"{step_dir(step)}/{rel}")
    try:
        got = store.read_into(f"{step_dir(step)}/{rel}", [(start, buffers) for start, buffers, _ in requests])
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing") from None
    for (start, _, end), n in zip(requests, got):
        if n != end - start:
            raise CheckpointError(f"{name} is truncated: it ends before byte {end}")
    for need, buf, direct in targets:
        p = need.piece
        if crc32(buf) != p.crc32:
            raise CheckpointError(
                f"{name}: piece {p.key!r} at {list(p.offsets)} (bytes {p.byte_offset}..{p.byte_offset + p.nbytes}) "
                "fails its checksum (corrupted data)"
            )
        if direct:
            continue
        src = torch.from_numpy(buf).view(DTYPES[p.dtype]).view(p.lengths)
        for offs, lens, dest in need.copies:
            view = src
            for d, (o, n) in enumerate(zip(offs, lens)):
                view = view.narrow(d, o - p.offsets[d], n)
            with torch.no_grad():
                dest.copy_(view)


def load_shards(uri: str, step: int, template: dict[str, torch.Tensor], *, storage_options: dict | None = None) -> dict:
    """Fill every tensor of `template` (plain or DTensor, any layout) in place from a committed checkpoint.

    Returns the manifest (its `train_state` restores the rest of the job). On a
    CheckpointError the template's contents are undefined: pieces are read
    straight into place and checked there.
    """
    store = Store(uri, storage_options)
    manifest = _manifest(store, step)
    pieces = read_index(store, step, manifest)
    plan = plan_reads(pieces, template, store.describe(step_dir(step)))
    if plan:
        with ThreadPoolExecutor(max_workers=min(8, len(plan))) as pool:
            for future in [pool.submit(_load_file, store, step, rel, needs) for rel, needs in plan.items()]:
                future.result()
    return manifest


def load_training_state(uri: str, step: int, model_parts, optimizer=None, *, storage_options: dict | None = None) -> dict:
    """Load parameters and optimizer state of `model_parts` (any layout) in place; returns the manifest.

    The optimizer then continues bitwise as the saved one would have, given
    the same learning rate (the scheduler lives in the manifest's `train_state`).
    """
    return load_shards(uri, step, state_tensors(model_parts, optimizer), storage_options=storage_options)
