"""Saving: every rank writes its own data file, one coordinator commits.

`write_shards` needs no communication: a rank writes its pieces back to back
into `data/gGGGGGG-rank_NNNNN.bin` (its generation and rank), fsyncs, and
returns the index rows. The
coordinator (the controller under Ray, rank 0 in a plain torch.distributed
program via `gather_and_commit`) checks that the rows cover every tensor,
writes the Arrow index, and then the manifest, atomically, last
(`storage.catalog.commit`, which needs no torch: a node agent commits too).
Until the manifest exists the directory is not a checkpoint, so a crash at
any point of a save leaves nothing that looks committed. The commit takes only files of the
generation that commits: a late write of an earlier one (a reused process
still writing in the background) has a name of its own and is never listed.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch
import torch.distributed as dist

from storage.format import (
    ALIGN,
    CheckpointError,
    align_up,
    crc32,
    crc32_combine,
    data_file,
    dtype_name,
    step_dir,
)
from storage.catalog import commit
from storage.copy_out import BLOCK as _BLOCK
from storage.copy_out import RECHECK_MAX as _RECHECK_MAX
from storage.copy_out import rows_from_heads
from storage.fs import FileMaps, Store
from storage.state import LocalPart, SnapshotPool, compute_done, copy_pieces, plan_writes

_ZEROS = memoryview(bytes(ALIGN))
"""The zero padding before a piece (less than `ALIGN` bytes)."""


def write_shards(
    uri: str, step: int, rank: int, tensors: dict, *, generation: int, storage_options: dict | None = None,
    layout_cache: dict | None = None, durable: bool = True, maps: FileMaps | None = None,
) -> list[dict]:
    """Write this rank's pieces of `tensors` (live tensors or a `snapshot`) into its file of `generation`; returns JSON-able index rows.

    Pieces stream into one file, each at a multiple of `ALIGN` bytes; each
    piece is read once (copied out and checksummed in the same pass), and the
    file's checksum is combined from the pieces'. Each row
    has the index columns (key, dtype, shape, offsets, lengths, file,
    byte_offset, nbytes, crc32) plus `file_bytes` and `file_crc32` of the whole
    data file, which the commit moves into the manifest. A rank with nothing to
    write returns no rows and creates no file. `layout_cache`: see `plan_writes`;
    `durable=False` for files that need not outlive the machine (the memory tier's), written through `maps` (kept
    between writes, `storage.fs.FileMaps`) where given.
    """
    plan = plan_writes(tensors, layout_cache)
    if not any(part.pieces for part in plan.values()):
        return []
    rel = data_file(rank, generation)
    template = _rows_template(plan, rel, layout_cache)
    rows = [dict(row) for row in template.rows]
    offset = template.size
    file_crc = pos = 0

    def buffers():
        # One piece at a time (a GPU piece reaches the CPU only when its turn comes), in blocks: each block is
        # checksummed just before the store copies it out, so the data is read from memory once. The file's
        # checksum follows from the pieces' (and the zero padding's): no second pass over a large piece.
        nonlocal file_crc, pos
        pieces = ((data, raw) for part in plan.values() for (_, data), raw in zip(part.pieces, part.raws or [None] * len(part.pieces)))
        for row, (data, raw) in zip(rows, pieces):
            if row["byte_offset"] > pos:
                pad = _ZEROS[: row["byte_offset"] - pos]
                file_crc = crc32(pad, file_crc)
                yield pad
            if raw is None:
                raw = memoryview(data.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
            if raw.nbytes <= _BLOCK:  # most pieces of a small model: a snapshot every step pays this loop per piece
                crc = crc32(raw)
                yield raw
            else:
                crc = 0
                for i in range(0, raw.nbytes, _BLOCK):
                    block = raw[i : i + _BLOCK]
                    crc = crc32(block, crc)
                    yield block
            row["crc32"] = crc
            file_crc = crc32(raw, file_crc) if raw.nbytes < _RECHECK_MAX else crc32_combine(file_crc, crc, raw.nbytes)
            pos = row["byte_offset"] + raw.nbytes

    store = Store(uri, storage_options)
    if maps is not None and not durable:
        store.write_mapped(f"{step_dir(step)}/{rel}", offset, buffers(), maps)
    else:
        store.write(f"{step_dir(step)}/{rel}", buffers(), durable=durable)
    for row in rows:
        row["file_bytes"], row["file_crc32"] = offset, file_crc
    template.last = rows
    return rows


class _RowsTemplate:
    """A rank's index rows for one layout but for their checksums, which are all that changes between its saves (a
    memory snapshot every step built 156 rows and encoded them to JSON each time: more CPU than copying the bytes of
    a small model's shard), and their JSON around the checksums. Kept in the layout cache (`plan_writes`) by the
    file's name, and valid while the plan cuts the same pieces (`signature`: the pieces' boxes, by identity, which
    the template holds so that their ids stay theirs, and the parts' dtypes)."""

    def __init__(self, plan: dict[str, LocalPart], rel: str):
        self.signature = _plan_signature(plan)
        self.rows: list[dict] = []  # without crc32, file_bytes and file_crc32
        offset = 0
        for key, part in plan.items():
            for box, data in part.pieces:
                offset = align_up(offset)
                nbytes = data.numel() * data.element_size()
                self.rows.append({
                    "key": key, "dtype": dtype_name(part.dtype), "shape": list(part.shape),
                    "offsets": list(box.offsets), "lengths": list(box.lengths), "file": rel,
                    "byte_offset": offset, "nbytes": nbytes,
                })
                offset += nbytes
        self.size = offset
        self.boxes = [box for part in plan.values() for box, _ in part.pieces]
        self.last: list[dict] | None = None  # the rows `write_shards` returned last from this template
        self._heads: list[str] | None = None  # each row's JSON up to its crc32 (`rows_json`)

    def heads(self) -> list[str]:
        """Each row's JSON up to its checksum (`storage.copy_out.rows_from_heads` completes them)."""
        if self._heads is None:
            self._heads = [json.dumps(row)[:-1] + ', "crc32": ' for row in self.rows]
        return self._heads

    def json(self, rows: list[dict]) -> str:
        """`rows` (as `write_shards` returned them from this template) as a JSON array, filling in the checksums."""
        return rows_from_heads(self.heads(), self.size, [row["crc32"] for row in rows], rows[0]["file_crc32"])


def _plan_signature(plan: dict[str, LocalPart]) -> tuple:
    return tuple(part.dtype for part in plan.values()), tuple(id(box) for part in plan.values() for box, _ in part.pieces)


def _rows_template(plan: dict[str, LocalPart], rel: str, layout_cache: dict | None) -> _RowsTemplate:
    """The rows template of `plan` written as `rel`: the cached one while the plan cuts the same pieces, else a new one."""
    cached = layout_cache.get(("rows", rel)) if layout_cache is not None else None
    if cached is not None and cached.signature == _plan_signature(plan):
        return cached
    template = _RowsTemplate(plan, rel)
    if layout_cache is not None:
        layout_cache[("rows", rel)] = template
    return template


@dataclass
class CopyPlan:
    """A rank's data file of live CPU tensors as another process copies it (`storage.copy_out.fill_from_process`):
    its name, size, the pieces' `regions` ((address, nbytes, offset in the file), in file order) and the rows'
    `template` (`heads()` for `storage.copy_out.rows_from_heads`). `keep` holds the contiguous copies some regions
    point into; the tensors the others point into must not change, or go, until the copy is done."""

    rel: str
    size: int
    regions: list[tuple[int, int, int]]
    template: _RowsTemplate
    keep: list[torch.Tensor]


def plan_copy(tensors: dict, rank: int, generation: int, layout_cache: dict | None = None) -> CopyPlan | None:
    """What another process copies to write `rank`'s file of `tensors` (live CPU tensors), as `write_shards` would
    (the same pieces, offsets and rows); None where the rank has nothing to write."""
    plan = plan_writes(tensors, layout_cache)
    if not any(part.pieces for part in plan.values()):
        return None
    rel = data_file(rank, generation)
    template = _rows_template(plan, rel, layout_cache)
    regions, keep = [], []
    for row, (_, data) in zip(template.rows, (piece for part in plan.values() for piece in part.pieces)):
        if data.device.type != "cpu":
            raise ValueError(f"{row['key']}: only CPU tensors can be copied out of the process (it is on {data.device})")
        if not data.is_contiguous():
            data = data.contiguous()
            keep.append(data)
        regions.append((data.data_ptr(), row["nbytes"], row["byte_offset"]))
    return CopyPlan(rel, template.size, regions, template, keep)


def rows_json(rows: list[dict], layout_cache: dict | None = None) -> str:
    """A rank's index rows as a JSON array: from the `layout_cache`'s template when they are the rows `write_shards`
    last returned with that cache (only their checksums are encoded anew), else with `json.dumps`."""
    template = layout_cache.get(("rows", rows[0]["file"])) if layout_cache is not None and rows else None
    if template is not None and template.last is rows:
        return template.json(rows)
    return json.dumps(rows)


def gather_and_commit(
    uri: str,
    step: int,
    rows: list[dict],
    *,
    generation: int,
    layout: dict,
    train_state: dict,
    group=None,
    storage_options: dict | None = None,
) -> None:
    """For a plain torch.distributed program: gather every rank's rows on rank 0 (as JSON bytes), commit there.

    Called by every rank of `group`; returns once the commit succeeded, and
    raises on every rank if it failed.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    payload = torch.frombuffer(bytearray(json.dumps(rows).encode()), dtype=torch.uint8).to(device)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)] if me == 0 else None
    dist.gather(padded, gathered, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    status = torch.zeros(1, dtype=torch.int64, device=device)
    error = None
    if me == 0:
        try:
            all_rows = []
            for buf, size in zip(gathered, sizes):
                all_rows.extend(json.loads(bytes(buf[: int(size.item())].cpu().numpy())))
            commit(uri, step, all_rows, generation=generation, layout=layout, train_state=train_state, storage_options=storage_options)
        except Exception as exc:  # noqa: BLE001 - reported to every rank, re-raised here
            error = exc
            status.fill_(1)
    dist.broadcast(status, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if error is not None:
        raise error
    if status.item():
        raise CheckpointError(f"commit of step {step} to {uri} failed on the coordinating rank")


class BackgroundWriter:
    """Asynchronous saves for one rank, at most one in flight: plan now, copy and write on a background thread.

    `submit` returns at once (after waiting for a save still in flight, whose
    snapshot buffers the new one reuses). The writer thread first copies the
    state into the snapshot buffers, which are kept from save to save (pinned
    on a GPU: warm memory, no allocation), then writes the copy. Training may
    run its next forward and backward meanwhile, since they read the state
    but do not change it, and calls `wait_snapshot()` before its optimizer
    step: the time blocked there, plus any wait in `submit`, is the save's
    training stall.

    `close` may be called from any thread (a trainer told to stop): it refuses
    further saves and waits for the one in flight, for at most `timeout_s`.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self._lock = threading.Lock()  # `_closed` and `_last` between `submit` and a `close` on another thread
        self._closed = False
        self._last: Future | None = None
        self._copied: Future | None = None
        self._waited = 0.0
        self._buffers = SnapshotPool()
        self._layout: dict = {}  # plan_writes' layout cache: a writer serves one trainer, whose layout is fixed

    def submit(
        self, uri: str, step: int, rank: int, tensors: dict, *, generation: int, storage_options: dict | None = None
    ) -> Future:
        """Start saving `tensors`; returns a future of `write_shards`' rows. Call `wait_snapshot()` before changing them."""
        t0 = time.perf_counter()
        with self._lock:
            self._check_open(step)
            last = self._last
        if last is not None:
            wait_futures([last])
        self._waited = time.perf_counter() - t0
        plan, ready = plan_writes(tensors, self._layout), compute_done(tensors)
        copied = Future()

        def copy_and_write() -> list[dict]:
            try:
                copy_pieces(plan, pool=self._buffers, ready=ready)  # the previous save is written: its buffers are free
            except BaseException as exc:
                copied.set_exception(exc)
                raise
            copied.set_result(None)
            return write_shards(uri, step, rank, plan, generation=generation, storage_options=storage_options)

        with self._lock:
            self._check_open(step)  # closed while this waited for the previous save
            self._copied = copied
            self._last = self._pool.submit(copy_and_write)
            return self._last

    def _check_open(self, step: int) -> None:
        if self._closed:
            raise CheckpointError(f"the background writer is closed: step {step} is not saved")

    def wait_snapshot(self) -> float:
        """Block until the last save has copied the state, which training may change from then on.

        Returns that save's training stall in seconds (0.0 when no save waits
        for this call); raises if the copy failed.
        """
        if self._copied is None:
            return 0.0
        t0 = time.perf_counter()
        copied, self._copied = self._copied, None
        copied.result()
        return self._waited + time.perf_counter() - t0

    def close(self, timeout_s: float | None = None) -> bool:
        """Refuse further saves, wait for the save in flight, then stop the thread and drop the snapshot buffers.

        Returns False when that save did not finish within `timeout_s` (None:
        no limit); it then goes on in the background, into its own
        generation's files, and `close` may be called again.
        """
        with self._lock:
            self._closed = True
            last = self._last
        if last is not None and not wait_futures([last], timeout=timeout_s).done:
            return False
        self._pool.shutdown(wait=True)  # the thread is idle now; joining it also waits for the future's callbacks
        self._buffers = SnapshotPool()
        return True
