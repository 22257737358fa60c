"""The checkpoint format without process groups: box arithmetic, the index, integrity, atomicity, no pickle."""

from __future__ import annotations

import itertools
from array import array
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

import storage
import storage.fs
from storage.boxes import PieceIndex, chunk_bounds, intersect, local_boxes, split_rows
from storage.format import INDEX, MANIFEST, data_file, step_dir
from storage.state import local_view

ROOT = Path(__file__).resolve().parents[1]
GEN = 1
"""The generation the tests' saves are written and committed by."""


# -- box arithmetic ------------------------------------------------------------------
def _torch_local(full: torch.Tensor, mesh_shape, coords, placements) -> torch.Tensor:
    """What torch's own placement code gives a mesh coordinate (left to right over mesh dims)."""
    local = full
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            local = p._split_tensor(local, mesh_shape[mesh_dim], with_padding=False)[0][coords[mesh_dim]]
    return local


CASES = [
    ((8, 6), (2, 2), [Shard(0), Shard(0)]),
    ((8, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP over TP (colwise)
    ((6, 10), (2, 2), [Shard(0), Shard(1)]),  # FSDP over TP (rowwise)
    ((7, 5), (3, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # uneven strided
    ((5, 3), (3,), [Shard(0)]),  # uneven
    ((2, 3), (3,), [Shard(0)]),  # one rank holds nothing
    ((9,), (2, 3), [Replicate(), Shard(0)]),  # HSDP
    ((12, 4), (2, 3), [_StridedShard(0, split_factor=3), Shard(0)]),
    ((10, 4), (2, 2, 2), [Replicate(), _StridedShard(0, split_factor=2), Shard(0)]),
]


@pytest.mark.parametrize("shape,mesh_shape,placements", CASES)
def test_local_boxes_match_torch_placements(shape, mesh_shape, placements):
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    seen = torch.zeros(shape, dtype=torch.int64)
    for coords in itertools.product(*(range(n) for n in mesh_shape)):
        expected = _torch_local(full, mesh_shape, coords, placements)
        boxes = local_boxes(shape, mesh_shape, coords, placements)
        assert sum(b.numel for b in boxes) == expected.numel()
        rebuilt = torch.empty_like(expected)
        for b in boxes:
            g = full[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))]
            local_view(rebuilt, b).copy_(g)
            if not any(isinstance(p, Replicate) and c for p, c in zip(placements, coords)):
                seen[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))] += 1
        assert torch.equal(rebuilt, expected), coords
    assert bool((seen == 1).all()), "the replica-0 shards must tile the tensor exactly once"


def test_chunk_bounds_follow_torch_chunk():
    for size, chunks in itertools.product(range(12), range(1, 6)):
        pieces = list(torch.arange(size).chunk(chunks)) if size else []
        for i in range(chunks):
            a, b = chunk_bounds(size, chunks, i)
            expected = pieces[i].tolist() if i < len(pieces) else []
            assert list(range(a, b)) == expected


def test_the_stored_dtypes_sizes_are_torchs():
    # storage.format checks each piece's byte count without importing torch: its table must agree with torch's.
    from storage.format import DTYPE_SIZES
    from storage.state import DTYPES

    assert {name: dtype.itemsize for name, dtype in DTYPES.items()} == DTYPE_SIZES
    assert all(str(dtype) == f"torch.{name}" for name, dtype in DTYPES.items())


def test_split_rows_and_intersect():
    from storage.boxes import Box

    box = Box((4, 0), (10, 3), (0, 0))
    parts = split_rows(box, itemsize=4, max_bytes=40)
    assert [p.lengths[0] for p in parts] == [3, 3, 3, 1]
    assert [p.offsets[0] for p in parts] == [4, 7, 10, 13] and [p.local[0] for p in parts] == [0, 3, 6, 9]
    assert intersect((0, 0), (4, 4), (2, 3), (5, 5)) == ((2, 3), (2, 1))
    assert intersect((0,), (4,), (4,), (2,)) is None


def test_piece_index_finds_exactly_the_overlaps():
    # A 2-D grid of stored pieces (3 x 4 blocks of a 12 x 16 tensor) queried with boxes of another grid.
    pieces = [((r, c), (4, 4), (r, c)) for r in range(0, 12, 4) for c in range(0, 16, 4)]
    index = PieceIndex(pieces)
    for qr, qc in itertools.product(range(0, 12, 3), range(0, 16, 5)):
        q_off, q_len = (qr, qc), (3, min(5, 16 - qc))
        got = sorted(p for p, _, _ in index.overlapping(q_off, q_len))
        brute = sorted(p[2] for p in pieces if intersect(q_off, q_len, p[0], p[1]))
        assert got == brute
    scalar = PieceIndex([((), (), "s")])
    assert [p for p, _, _ in scalar.overlapping((), ())] == ["s"]


# -- one-process checkpoints -------------------------------------------------------------
def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.w": torch.randn(5, 7, generator=g),
        "model.b": torch.randn(7, generator=g).to(torch.bfloat16),
        "optim.w.step": torch.tensor(3.0),
        "model.ids": torch.arange(11, dtype=torch.int64),
    }


def _save(uri: str, step: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A two-file checkpoint written as two 'ranks' with disjoint keys."""
    state = _state(seed)
    keys = sorted(state)
    rows = storage.write_shards(uri, step, 0, {k: state[k] for k in keys[:2]}, generation=GEN)
    rows += storage.write_shards(uri, step, 1, {k: state[k] for k in keys[2:]}, generation=GEN)
    storage.commit(uri, step, rows, layout={"dp_shard": 2}, train_state={"step": step, "seeds": [seed]}, generation=GEN)
    return state


def _empty_like(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


@pytest.mark.parametrize("scheme", ["", "file://", "memory://"])
def test_round_trip_and_listing(tmp_path, scheme):
    uri = f"memory://{tmp_path.name}/ck" if scheme == "memory://" else f"{scheme}{tmp_path}/ck"
    storage.check_writable(uri)
    _save(uri, 10, seed=1)
    state = _save(uri, 20, seed=2)
    template = _empty_like(state)
    manifest = storage.load_shards(uri, 20, template)
    assert manifest["train_state"] == {"step": 20, "seeds": [2]}
    assert all(torch.equal(template[k], state[k]) and template[k].dtype == state[k].dtype for k in state)
    listed = storage.list_checkpoints(uri)
    assert [c["step"] for c in listed] == [20, 10] and listed[0]["layout"] == {"dp_shard": 2} and listed[0]["files"] == 2
    assert storage.latest_valid(uri) == 20


def test_load_rejects_wrong_shape_and_missing_key(tmp_path):
    uri = str(tmp_path)
    state = _save(uri, 1)
    with pytest.raises(storage.CheckpointError, match="model.w"):
        storage.load_shards(uri, 1, {"model.w": torch.zeros(5, 8)})
    with pytest.raises(storage.CheckpointError, match="no tensor 'model.nope'"):
        storage.load_shards(uri, 1, {"model.nope": torch.zeros_like(state["model.w"])})


def _data(tmp_path, step=1, rank=0) -> Path:
    return tmp_path / step_dir(step) / data_file(rank, GEN)


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def test_flipped_bit_is_named(tmp_path):
    state = _save(str(tmp_path), 1)
    _flip(_data(tmp_path), 3)
    with pytest.raises(storage.CheckpointError, match=r"rank_00000\.bin.*checksum"):
        storage.verify(str(tmp_path), 1)
    with pytest.raises(storage.CheckpointError, match=r"rank_00000\.bin.*checksum"):
        storage.load_shards(str(tmp_path), 1, _empty_like(state))


def test_truncated_file_is_named(tmp_path):
    state = _save(str(tmp_path), 1)
    path = _data(tmp_path, rank=1)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(storage.CheckpointError, match=r"rank_00001\.bin is truncated"):
        storage.verify(str(tmp_path), 1)
    with pytest.raises(storage.CheckpointError, match=r"rank_00001\.bin is truncated"):
        storage.load_shards(str(tmp_path), 1, _empty_like(state))


def test_missing_data_file_is_named(tmp_path):
    state = _save(str(tmp_path), 1)
    _data(tmp_path, rank=1).unlink()
    with pytest.raises(storage.CheckpointError, match=r"rank_00001\.bin is missing"):
        storage.verify(str(tmp_path), 1)
    with pytest.raises(storage.CheckpointError, match=r"rank_00001\.bin is missing"):
        storage.load_shards(str(tmp_path), 1, _empty_like(state))


def test_missing_or_garbled_manifest(tmp_path):
    _save(str(tmp_path), 1)
    _save(str(tmp_path), 2)
    manifest = tmp_path / step_dir(2) / MANIFEST
    manifest.write_text('{"format": "elastic-checkpoint", "version": 1, "step": 2, "files": ')
    with pytest.raises(storage.CheckpointError, match=r"step_00000002/manifest\.json is garbled"):
        storage.verify(str(tmp_path), 2)
    assert "garbled" in storage.list_checkpoints(str(tmp_path))[0]["error"]
    manifest.unlink()
    with pytest.raises(storage.CheckpointError, match=r"manifest\.json is missing"):
        storage.read_manifest(str(tmp_path), 2)
    assert [c["step"] for c in storage.list_checkpoints(str(tmp_path))] == [1]


def _rewrite_index(tmp_path, step: int, mutate) -> None:
    """Replace the index with mutated rows and re-seal it in the manifest, as a buggy or malicious writer might."""
    import pyarrow as pa

    from storage.format import crc32, encode_index

    d = tmp_path / step_dir(step)
    rows = pa.ipc.open_file(pa.py_buffer((d / INDEX).read_bytes())).read_all().to_pylist()
    mutate(rows)
    data = encode_index(rows)
    (d / INDEX).write_bytes(data)
    m = json.loads((d / MANIFEST).read_text())
    m["index"].update(bytes=len(data), crc32=crc32(data))
    (d / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda rows: rows[0].update(byte_offset=10_000), r"outside data/g000001-rank_0000\d\.bin"),
        (lambda rows: rows[0].update(file="../../../etc/passwd"), r"'\.\./\.\./\.\./etc/passwd', outside the checkpoint"),
        (lambda rows: rows[0].update(file="data/rank_00007.bin"), r"'data/rank_00007\.bin', outside the checkpoint"),
        (lambda rows: rows[0].update(offsets=[4, 0], lengths=[5, 7]), r"outside its shape"),
        (lambda rows: rows[0].update(byte_offset=None), r"missing values in column 'byte_offset'"),
    ],
)
def test_index_row_pointing_outside(tmp_path, mutate, match):
    state = _save(str(tmp_path), 1)
    _rewrite_index(tmp_path, 1, mutate)
    with pytest.raises(storage.CheckpointError, match=match):
        storage.verify(str(tmp_path), 1)
    with pytest.raises(storage.CheckpointError, match=match):
        storage.load_shards(str(tmp_path), 1, _empty_like(state))


def _index_with_keys(tmp_path, step: int, offsets: list[int], data: bytes) -> None:
    """Replace the index's `key` column by raw buffers (offsets, UTF-8 bytes), sealed in the manifest: a forged index."""
    import pyarrow as pa

    from storage.format import INDEX_COLUMNS, INDEX_SCHEMA, crc32

    d = tmp_path / step_dir(step)
    table = pa.ipc.open_file(pa.py_buffer((d / INDEX).read_bytes())).read_all().combine_chunks()
    keys = pa.Array.from_buffers(pa.string(), len(offsets) - 1, [None, pa.py_buffer(bytes(memoryview(array("i", offsets)))), pa.py_buffer(data)])
    forged = pa.Table.from_arrays([keys if n == "key" else table.column(n).chunk(0) for n in INDEX_COLUMNS], schema=INDEX_SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, INDEX_SCHEMA) as writer:
        writer.write_table(forged)
    raw = sink.getvalue().to_pybytes()
    (d / INDEX).write_bytes(raw)
    m = json.loads((d / MANIFEST).read_text())
    m["index"].update(bytes=len(raw), crc32=crc32(raw))
    (d / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize(
    "offsets,data",
    [
        ([0, 9, 7], b"model.b" + b"model.w"),  # offsets that run backwards: crashed the decode (SystemError)
        ([0, 7, 14], b"\xffodel.b" + b"model.w"),  # not UTF-8: crashed the decode (UnicodeDecodeError)
    ],
)
def test_index_with_corrupt_buffers_is_named(tmp_path, offsets, data):
    state = {"model.b": torch.ones(3), "model.w": torch.zeros(2)}
    rows = storage.write_shards(str(tmp_path), 1, 0, state, generation=GEN)
    storage.commit(str(tmp_path), 1, rows, layout={}, train_state={}, generation=GEN)
    _index_with_keys(tmp_path, 1, offsets, data)
    with pytest.raises(storage.CheckpointError, match=r"index\.arrow is not a readable Arrow file .*(offset|UTF8)"):
        storage.verify(str(tmp_path), 1)
    assert storage.latest_valid(str(tmp_path)) is None


def test_corrupt_index_is_named(tmp_path):
    _save(str(tmp_path), 1)
    _flip(tmp_path / step_dir(1) / INDEX, 40)
    with pytest.raises(storage.CheckpointError, match=r"index\.arrow fails its checksum"):
        storage.verify(str(tmp_path), 1)


def test_fallback_to_previous_good_checkpoint(tmp_path):
    for step in (1, 2, 3):
        _save(str(tmp_path), step, seed=step)
    _flip(_data(tmp_path, step=3), 0)
    (tmp_path / step_dir(2) / INDEX).unlink()
    skipped = []
    assert storage.latest_valid(str(tmp_path), on_skip=lambda s, why: skipped.append((s, why))) == 1
    assert [s for s, _ in skipped] == [3, 2]
    assert "checksum" in skipped[0][1] and "index.arrow is missing" in skipped[1][1]


def test_retention_and_incomplete_dirs(tmp_path):
    uri = str(tmp_path)
    for step in (1, 2, 3, 4):
        _save(uri, step)
    storage.write_shards(uri, 0, 0, _state(), generation=GEN)  # an old save that never committed
    storage.write_shards(uri, 5, 0, _state(), generation=GEN)  # a save in flight
    assert storage.retain(uri, 2) == [2, 1, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(3), step_dir(4), step_dir(5)]
    assert [c["step"] for c in storage.list_checkpoints(uri)] == [4, 3]
    assert storage.clean_incomplete(uri) == [5]
    assert storage.latest_valid(uri) == 4


def test_unwritable_uri_fails_early(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(storage.CheckpointError, match="is not writable"):
        storage.check_writable(str(tmp_path / "file" / "ckpt"))


_KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import storage
    from storage import catalog, fs as sfs

    uri, point = sys.argv[1], sys.argv[2]
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    state = {"model.w": torch.arange(4096.0).view(64, 64), "model.b": torch.ones(3)}
    rows = storage.write_shards(uri, 1, 0, state, generation=1)
    storage.commit(uri, 1, rows, layout={}, train_state={"step": 1}, generation=1)

    write, write_atomic, replace = sfs.Store.write, sfs.Store.write_atomic, os.replace
    def partial_write(self, rel, buffers, durable=True):
        if rel.endswith(".bin"):
            first = bytes(memoryview(next(iter(buffers))).cast("B"))
            write(self, rel, [first[: len(first) // 2]], durable=durable)
            die()
        return write(self, rel, buffers, durable=durable)
    if point == "data":
        sfs.Store.write = partial_write
    elif point == "before_index":
        catalog.encode_index = lambda rows: die()
    elif point == "before_manifest":
        sfs.Store.write_atomic = lambda self, rel, data, **kwargs: die()
    elif point == "manifest_rename":
        sfs.os.replace = lambda *args, **kwargs: die()
    rows = storage.write_shards(uri, 2, 0, {k: v + 1 for k, v in state.items()}, generation=1)
    storage.commit(uri, 2, rows, layout={}, train_state={"step": 2}, generation=1)
    """
)


def test_kill_during_save_never_commits(tmp_path):
    points = ["data", "before_index", "before_manifest", "manifest_rename"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {
        p: subprocess.Popen([sys.executable, "-c", _KILLER, str(tmp_path / p), p], env=env, stderr=subprocess.PIPE)
        for p in points
    }
    for point, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, (point, err.decode())
        uri = str(tmp_path / point)
        assert (tmp_path / point / step_dir(2)).is_dir()
        assert [c["step"] for c in storage.list_checkpoints(uri)] == [1], point
        assert storage.latest_valid(uri) == 1
        with pytest.raises(storage.CheckpointError, match="not a committed checkpoint"):
            storage.read_manifest(uri, 2)
        assert storage.clean_incomplete(uri) == [2]
        assert not (tmp_path / point / step_dir(2)).exists()


class _Payload:
    """Unpickling this creates a marker file: proof that something unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_planted_pickle_is_never_unpickled(tmp_path):
    uri = str(tmp_path / "ck")
    state = _save(uri, 1)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    d = tmp_path / "ck" / step_dir(1)
    (d / "data" / "extra.pkl").write_bytes(payload)
    (d / "data.pkl").write_bytes(payload)
    storage.verify(uri, 1)
    storage.load_shards(uri, 1, _empty_like(state))
    # The payload in place of the index, sealed in the manifest so that only parsing can stop it.
    (d / INDEX).write_bytes(payload)
    m = json.loads((d / MANIFEST).read_text())
    from storage.format import crc32

    m["index"].update(bytes=len(payload), crc32=crc32(payload))
    (d / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(storage.CheckpointError, match="not a readable Arrow file"):
        storage.load_shards(uri, 1, _empty_like(state))
    # ... and in place of a data file and of the manifest.
    (d / data_file(0, GEN)).write_bytes(payload)
    with pytest.raises(storage.CheckpointError):
        storage.verify(uri, 1)
    (d / MANIFEST).write_bytes(payload)
    with pytest.raises(storage.CheckpointError, match="garbled"):
        storage.verify(uri, 1)
    assert not marker.exists()
    for source in (ROOT / "storage").glob("*.py"):
        text = source.read_text()
        assert "import pickle" not in text and "torch.load" not in text and "torch.save" not in text, source


def test_corrupt_newest_and_remove_all(tmp_path):
    uri = str(tmp_path)
    _save(uri, 1)
    _save(uri, 2)
    target = storage.corrupt_newest(uri, seed=3)
    assert target.startswith(f"{tmp_path}/{step_dir(2)}/data/g000001-rank_0000")
    skipped = []
    assert storage.latest_valid(uri, on_skip=lambda s, why: skipped.append(s)) == 1 and skipped == [2]
    (tmp_path / "notes.txt").write_text("kept")
    assert storage.remove_all(uri) == [2, 1]
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert storage.corrupt_newest(uri) is None


def test_background_writer_saves_the_snapshot(tmp_path):
    uri = str(tmp_path)
    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    writer = storage.BackgroundWriter()
    futures = []
    for step in (1, 2):
        future = writer.submit(uri, step, 0, state, generation=GEN)
        assert writer.wait_snapshot() >= 0
        assert writer.wait_snapshot() == 0.0  # nothing left to wait for
        for v in state.values():  # training goes on and changes the live tensors
            v.add_(1)
        futures.append(future)
    writer.close()
    for step, future in zip((1, 2), futures):
        storage.commit(uri, step, future.result(), layout={}, train_state={"step": step}, generation=GEN)
    template = _empty_like(state)
    storage.load_shards(uri, 1, template)
    assert all(torch.equal(template[k], expected[k]) for k in expected)
    storage.load_shards(uri, 2, template)
    assert all(torch.equal(template[k], expected[k] + 1) for k in expected)


def test_state_tensors_creates_fresh_optimizer_state():
    def run(save_first: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        if save_first:
            state = storage.state_tensors([model], opt)
            assert {k for k in state if k.startswith("optim.weight")} == {"optim.weight.exp_avg", "optim.weight.exp_avg_sq", "optim.weight.step"}
            assert state["optim.weight.step"].item() == 0 and not state["optim.weight.exp_avg"].any()
        for _ in range(2):
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        return model.weight.detach().clone()

    assert torch.equal(run(True), run(False))


def test_shallow_verify_checks_structure_not_data(tmp_path):
    uri = str(tmp_path)
    _save(uri, 1)
    _save(uri, 2)
    _flip(_data(tmp_path, step=2), 0)
    assert storage.verify(uri, 2, deep=False)["step"] == 2
    assert storage.latest_valid(uri, deep=False) == 2 and storage.latest_valid(uri) == 1
    _data(tmp_path, step=2, rank=1).unlink()
    assert storage.latest_valid(uri, deep=False) == 1


# -- retention: the newest checkpoint that verifies is never deleted -------------------------------------------
def _garble(tmp_path, step: int) -> None:
    (tmp_path / step_dir(step) / MANIFEST).write_text("garbage{")


def _steps_on_disk(tmp_path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in tmp_path.iterdir() if p.name.startswith("step_"))


def test_retention_keeps_the_newest_valid_checkpoint_and_the_save_in_progress(tmp_path):
    uri = str(tmp_path)
    _save(uri, 50)
    _garble(tmp_path, 50)  # e.g. an old run's checkpoint, garbled
    _save(uri, 10)
    storage.write_shards(uri, 12, 0, _state(), generation=GEN)  # a save of step 12 in progress: no manifest yet
    assert storage.retain(uri, 1, in_progress=[12]) == []
    assert storage.retain(uri, 1) == []  # 12 is newer than the newest valid checkpoint: not cleaned either
    assert _steps_on_disk(tmp_path) == [10, 12, 50]
    assert storage.latest_valid(uri) == 10


def test_retention_counts_only_checkpoints_that_verify(tmp_path):
    uri = str(tmp_path)
    for step in (5, 10, 20, 25, 30, 40):
        _save(uri, step)
    _garble(tmp_path, 25)
    (tmp_path / step_dir(40) / INDEX).unlink()  # committed, but broken
    storage.write_shards(uri, 3, 0, _state(), generation=GEN)  # an old save that never committed
    storage.write_shards(uri, 15, 0, _state(), generation=GEN)  # below the newest valid checkpoint, but still being written
    storage.write_shards(uri, 35, 0, _state(), generation=GEN)  # a save in flight
    # Kept: 30 and 20 (the two newest that verify), 40 (broken, newer: kept for inspection), 35 and 15 (in progress).
    assert storage.retain(uri, 2, in_progress=[15]) == [25, 10, 5, 3]
    assert _steps_on_disk(tmp_path) == [15, 20, 30, 35, 40]
    assert storage.retain(uri, 2) == [15]  # no longer in progress: below the newest valid checkpoint, cleaned
    assert storage.latest_valid(uri) == 30


def test_retention_without_a_valid_checkpoint_deletes_nothing(tmp_path):
    uri = str(tmp_path)
    _save(uri, 5)
    _save(uri, 7)
    _garble(tmp_path, 7)
    (tmp_path / step_dir(5) / data_file(1, GEN)).unlink()
    storage.write_shards(uri, 2, 0, _state(), generation=GEN)
    assert storage.retain(uri, 1) == []
    assert _steps_on_disk(tmp_path) == [2, 5, 7]


# -- I/O errors and hostile manifests fall back to an older checkpoint ----------------------------------------------
def _nested_manifest(path: Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda d: ((d / MANIFEST).unlink(), (d / MANIFEST).mkdir()), r"manifest\.json cannot be read: Is a directory"),
        (lambda d: ((d / INDEX).unlink(), (d / INDEX).mkdir()), r"index\.arrow cannot be read: Is a directory"),
        (lambda d: _nested_manifest(d / MANIFEST), r"manifest\.json is garbled: nested too deeply"),
    ],
)
def test_unreadable_checkpoint_is_skipped_with_the_reason(tmp_path, damage, match):
    uri = str(tmp_path)
    _save(uri, 1)
    _save(uri, 2)
    damage(tmp_path / step_dir(2))
    with pytest.raises(storage.CheckpointError, match=match):
        storage.verify(uri, 2)
    skipped = []
    assert storage.latest_valid(uri, on_skip=lambda s, why: skipped.append((s, why))) == 1
    assert [s for s, _ in skipped] == [2] and re.search(match, skipped[0][1])
    listed = storage.list_checkpoints(uri)
    assert [c["step"] for c in listed] == [2, 1] and ("error" in listed[0]) == ("manifest" in match)
    assert storage.retain(uri, 1) == []  # newer than the newest valid checkpoint: kept for inspection
    assert storage.clean_incomplete(uri) == []  # it has a manifest (of sorts): not an incomplete save


# -- untrusted names and planted links never reach outside the checkpoint --------------------------------------------
@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "data/../../../x", "data/rank_00000.bin/../../../x", "data/rank_00000.bin\n"])
def test_manifest_naming_a_file_outside_is_refused(tmp_path, name):
    outside = tmp_path / "x"
    outside.write_bytes(b"12345")
    uri = str(tmp_path / "ck")
    _save(uri, 1)
    path = tmp_path / "ck" / step_dir(1) / MANIFEST
    m = json.loads(path.read_text())
    m["files"] = {name: {"bytes": 5, "crc32": 0}}  # the only file, so that corrupt_newest would pick it
    path.write_text(json.dumps(m))
    with pytest.raises(storage.CheckpointError, match=re.escape(repr(name)) + " that is not data/gGGGGGG-rank_NNNNN.bin"):
        storage.verify(uri, 1)
    assert storage.corrupt_newest(uri) is None  # the only checkpoint's manifest is refused: nothing to corrupt
    assert outside.read_bytes() == b"12345"


def _outside_copy(tmp_path, step: int) -> Path:
    """A valid checkpoint of `step` in a directory outside the checkpoint root under test."""
    _save(str(tmp_path / "outside"), step, seed=9)
    return tmp_path / "outside" / step_dir(step)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_step_dir_that_is_a_link_is_never_followed(tmp_path):
    uri = str(tmp_path / "ck")
    target = _outside_copy(tmp_path, 3)
    before = _tree(target)
    _save(uri, 2)
    (tmp_path / "ck" / step_dir(3)).symlink_to(target, target_is_directory=True)
    with pytest.raises(storage.CheckpointError, match=r"step_00000003/manifest\.json cannot be read: step_00000003 is a symbolic link"):
        storage.verify(uri, 3)
    with pytest.raises(storage.CheckpointError, match="step_00000003 is a symbolic link"):
        storage.load_shards(uri, 3, _empty_like(_state()))
    skipped = []
    assert storage.latest_valid(uri, on_skip=lambda s, why: skipped.append(s)) == 2 and skipped == [3]
    assert "error" in storage.list_checkpoints(uri)[0]
    assert storage.corrupt_newest(uri).startswith(f"{uri}/{step_dir(2)}/")  # the link's checkpoint is skipped
    with pytest.raises(OSError, match="step_00000003 is a symbolic link"):
        storage.write_shards(uri, 3, 0, _state(), generation=GEN)  # a save never writes through it either
    assert storage.retain(uri, 1) == []  # newer than the newest valid checkpoint: kept for inspection
    assert storage.remove_all(uri) == [3, 2]
    assert not (tmp_path / "ck" / step_dir(3)).is_symlink() and _tree(target) == before
    # Older than the newest valid checkpoint, retention deletes the link, not what it points to.
    _save(uri, 4)
    (tmp_path / "ck" / step_dir(3)).symlink_to(target, target_is_directory=True)
    assert storage.retain(uri, 1) == [3] and _tree(target) == before


def test_data_file_or_data_dir_that_is_a_link_is_never_followed(tmp_path):
    uri = str(tmp_path / "ck")
    target = _outside_copy(tmp_path, 1)
    before = _tree(target)
    _save(uri, 1)
    link = tmp_path / "ck" / step_dir(1) / data_file(0, GEN)
    link.unlink()
    link.symlink_to(target / data_file(0, GEN))  # the same bytes: following it would verify
    with pytest.raises(storage.CheckpointError, match=r"rank_00000\.bin cannot be read: .*rank_00000\.bin is a symbolic link"):
        storage.verify(uri, 1)
    with pytest.raises(storage.CheckpointError, match=r"rank_00000\.bin is a symbolic link"):
        storage.load_shards(uri, 1, _empty_like(_state()))
    assert storage.latest_valid(uri) is None
    for seed in range(6):  # whichever file it picks, the outside one is never written
        try:
            storage.corrupt_newest(uri, seed=seed)
        except storage.CheckpointError as exc:
            assert "symbolic link" in str(exc)
    assert _tree(target) == before
    data_dir = tmp_path / "ck" / step_dir(1) / "data"
    shutil.rmtree(data_dir)
    data_dir.symlink_to(target / "data", target_is_directory=True)
    with pytest.raises(storage.CheckpointError, match=r"step_00000001/data is a symbolic link"):
        storage.verify(uri, 1)
    with pytest.raises(OSError, match="data is a symbolic link"):
        storage.write_shards(uri, 1, 0, _state(), generation=GEN)
    assert storage.remove_all(uri) == [1] and _tree(target) == before


def test_root_that_is_a_link_is_followed(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "root").symlink_to(tmp_path / "real", target_is_directory=True)
    uri = str(tmp_path / "root")
    state = _save(uri, 1)
    assert storage.verify(uri, 1)["step"] == 1 and storage.latest_valid(uri) == 1
    template = _empty_like(state)
    storage.load_shards(uri, 1, template)
    assert all(torch.equal(template[k], state[k]) for k in state)
    assert (tmp_path / "real" / step_dir(1) / MANIFEST).is_file()


# -- generations: a late write of an earlier one never lands in the next one's checkpoint ---------------------------
def test_late_write_of_an_earlier_generation_is_fenced_by_name(tmp_path):
    uri = str(tmp_path)
    old, new = _state(seed=1), _state(seed=2)
    rows = storage.write_shards(uri, 7, 0, new, generation=4)
    storage.commit(uri, 7, rows, layout={}, train_state={"step": 7}, generation=4)
    late = storage.write_shards(uri, 7, 0, old, generation=3)  # a warm process of generation 3, still writing step 7
    assert {r["file"] for r in rows} == {"data/g000004-rank_00000.bin"} and {r["file"] for r in late} == {"data/g000003-rank_00000.bin"}
    assert storage.verify(uri, 7)["generation"] == 4
    template = _empty_like(new)
    storage.load_shards(uri, 7, template)
    assert all(torch.equal(template[k], new[k]) for k in new)
    # A commit lists only files of the generation that commits.
    with pytest.raises(storage.CheckpointError, match=r"'data/g000003-rank_00000\.bin', not a file of generation 4"):
        storage.commit(uri, 8, late, layout={}, train_state={"step": 8}, generation=4)
    legacy = [{**r, "file": "data/rank_00000.bin"} for r in rows]
    with pytest.raises(storage.CheckpointError, match=r"'data/rank_00000\.bin', not a file of generation 4"):
        storage.commit(uri, 8, legacy, layout={}, train_state={"step": 8}, generation=4)
    with pytest.raises(ValueError, match="generation must be a non-negative int"):
        storage.write_shards(uri, 9, 0, new, generation=-1)


def test_checkpoint_of_the_first_format_still_loads(tmp_path):
    """Data files named data/rank_NNNNN.bin (before generations were in the name) load and verify."""
    uri = str(tmp_path)
    state = _save(uri, 1)
    d = tmp_path / step_dir(1)
    for rank in (0, 1):
        (d / data_file(rank, GEN)).rename(d / f"data/rank_{rank:05d}.bin")
    m = json.loads((d / MANIFEST).read_text())
    m["files"] = {f"data/rank_{r:05d}.bin": e for r, e in enumerate(m["files"].values())}
    (d / MANIFEST).write_text(json.dumps(m))
    _rewrite_index(tmp_path, 1, lambda rows: [r.update(file=r["file"].replace(f"g{GEN:06d}-", "")) for r in rows])
    assert sorted(storage.verify(uri, 1)["files"]) == ["data/rank_00000.bin", "data/rank_00001.bin"]
    template = _empty_like(state)
    storage.load_shards(uri, 1, template)
    assert all(torch.equal(template[k], state[k]) for k in state)


def test_background_writer_close_from_another_thread_waits_for_the_save(tmp_path, monkeypatch):
    uri = str(tmp_path)
    state = _state()
    writing, release = threading.Event(), threading.Event()
    write = storage.fs.Store.write

    def held_write(self, rel, buffers, durable=True):  # the data file's write waits until the test lets it go on
        if rel.endswith(".bin"):
            writing.set()
            release.wait(60)
        return write(self, rel, buffers, durable=durable)

    monkeypatch.setattr(storage.fs.Store, "write", held_write)
    writer = storage.BackgroundWriter()
    future = writer.submit(uri, 1, 0, state, generation=GEN)
    writer.wait_snapshot()
    assert writing.wait(30)
    assert writer.close(timeout_s=0.05) is False  # the write is held: it did not finish in time
    with pytest.raises(storage.CheckpointError, match="writer is closed: step 2 is not saved"):
        writer.submit(uri, 2, 0, state, generation=GEN)
    closed = []
    closer = threading.Thread(target=lambda: closed.append(writer.close()))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and not future.done()  # close waits for the save in flight
    release.set()
    closer.join(30)
    assert closed == [True] and future.done()
    storage.commit(uri, 1, future.result(), layout={}, train_state={"step": 1}, generation=GEN)
    assert storage.verify(uri, 1)["step"] == 1


def test_crc32_combine_is_zlibs_and_the_python_fallback_agrees():
    # The writer derives a file's CRC-32 from its pieces'; zlib's own combine (through ctypes) and the Python
    # fallback must both give the CRC-32 of the concatenation, including across empty and odd-sized parts.
    import zlib

    from storage.format import COMBINE_IS_CHEAP, crc32_combine, crc32_combine_py

    assert COMBINE_IS_CHEAP  # libz is there on every machine this runs on; without it saves cost a second CRC pass
    rng = random.Random(7)
    for a_len, b_len in [(0, 0), (0, 5), (5, 0), (1, 1), (63, 4097), (1 << 16, 3), (1000, 1 << 20)]:
        a, b = rng.randbytes(a_len), rng.randbytes(b_len)
        want = zlib.crc32(a + b)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), b_len) == want
        assert crc32_combine_py(zlib.crc32(a), zlib.crc32(b), b_len) == want


def test_the_checksum_is_zlibs_crc32_whichever_library_computes_it():
    # Checkpoints written with ISA-L's CRC-32 (storage.format.crc32) must verify where only zlib is there, and back.
    import zlib

    from storage.format import _crc32, crc32

    assert _crc32 is not zlib.crc32  # the fast one is installed (make setup): otherwise this test proves nothing
    rng = random.Random(11)
    for n in (0, 1, 63, 4096, 5 * 1024 + 1, 1 << 20, (3 << 20) + 7):
        data = rng.randbytes(n)
        seed = rng.getrandbits(32)
        assert crc32(data) == zlib.crc32(data)
        assert crc32(memoryview(data)[n // 3 :], seed) == zlib.crc32(memoryview(data)[n // 3 :], seed)


def test_a_load_names_the_byte_ranges_it_reads_before_it_reads_any(tmp_path):
    # Three "ranks" each wrote a third of a 9-row tensor. A rank of a 2-way layout reading rows 0-4 reads the first two
    # files only, and learns which bytes before reading: a restore from node memory fetches exactly those (elastic.agent).
    from storage.boxes import Box
    from storage.state import LocalPart

    full = torch.arange(36, dtype=torch.float32).reshape(9, 4)
    uri = str(tmp_path / "ck")
    rows = []
    for rank in range(3):
        part = LocalPart((9, 4), full.dtype, [(Box((3 * rank, 0), (3, 4), (0, 0)), full[3 * rank:3 * rank + 3].clone())])
        rows += storage.write_shards(uri, 5, rank, {"w": part}, generation=GEN)
    storage.commit(uri, 5, rows, layout={"dp_shard": 3}, train_state={"step": 5}, generation=GEN)
    files = [data_file(rank, GEN) for rank in range(3)]
    held = tmp_path / "elsewhere"
    held.mkdir()
    for name in files:  # no file is where the load looks until its callback puts it there
        os.rename(tmp_path / "ck" / step_dir(5) / name, held / Path(name).name)
    local = torch.zeros(5, 4)
    asked = []

    def fetch(ranges):
        assert not local.any()  # nothing was read yet
        asked.append(ranges)
        for name in ranges:
            os.rename(held / Path(name).name, tmp_path / "ck" / step_dir(5) / name)

    storage.load_into(uri, 5, {"w": ((9, 4), local, [Box((0, 0), (5, 4), (0, 0))])}, before_read=fetch)
    row = 4 * 4  # bytes of one row: rank 0's three rows are all read, two of rank 1's are in its one piece
    assert asked == [{files[0]: [(0, 3 * row)], files[1]: [(0, 3 * row)]}] and local.equal(full[:5])
    assert (held / Path(files[2]).name).exists()  # never asked for, never fetched


def test_rows_kept_from_save_to_save_change_only_their_checksums_and_follow_a_new_layout(tmp_path):
    # A memory snapshot every step reuses its layout's rows and their JSON (storage.writer._RowsTemplate): each save's
    # rows must still be what that save wrote (checksums included), and a save with other pieces (another layout,
    # another dtype) must get rows of its own.
    cache: dict = {}
    state = {"model.w": torch.randn(8, 4), "model.b": torch.randn(3)}

    def save(step: int, tensors: dict) -> list[dict]:
        rows = storage.write_shards(str(tmp_path), step, 0, tensors, generation=1, layout_cache=cache)
        encoded = storage.rows_json(rows, cache)
        assert json.loads(encoded) == rows and encoded == json.dumps(rows)
        storage.commit(str(tmp_path), step, json.loads(encoded), generation=1, layout={"dp_shard": 1}, train_state={})
        loaded = {k: torch.empty_like(v) for k, v in tensors.items()}
        storage.load_shards(str(tmp_path), step, loaded)
        assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
        return rows

    first = save(1, state)
    state["model.w"].add_(1.0)
    second = save(2, state)
    assert [r["crc32"] for r in first] != [r["crc32"] for r in second]
    assert [{k: v for k, v in r.items() if "crc32" not in k} for r in first] == \
        [{k: v for k, v in r.items() if "crc32" not in k} for r in second]
    assert storage.rows_json(first, cache) == json.dumps(first)  # not the last save's rows: encoded whole
    wider = save(3, {"model.w": torch.randn(8, 6), "model.b": state["model.b"]})
    assert wider[0]["shape"] == [8, 6] and wider[0]["nbytes"] == 8 * 6 * 4
    halved = save(4, {"model.w": torch.randn(8, 6).half(), "model.b": state["model.b"]})
    assert halved[0]["dtype"] == "float16" and halved[0]["nbytes"] == 8 * 6 * 2
