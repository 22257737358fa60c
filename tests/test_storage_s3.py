"""Checkpoints over s3:// (pyarrow for the bulk bytes, s3fs for the rest) against a moto server on 127.0.0.1 (the `s3` fixture of conftest.py), saved and loaded at different world sizes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_storage_lease import check_lease_semantics, check_renewal
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import storage
import storage.fs
from storage.fs import Store


def _full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"model.w": torch.randn(10, 6, generator=g), "model.norm": torch.randn(6, generator=g), "optim.w.step": torch.tensor(4.0)}


def _sharded(full: dict, template: bool) -> dict:
    """`full` sharded over all ranks (w by rows, norm replicated); zeros when `template`."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    out = {}
    for key, placement in (("model.w", Shard(0)), ("model.norm", Replicate())):
        src = torch.zeros_like(full[key]) if template else full[key]
        out[key] = distribute_tensor(src, mesh, [placement], src_data_rank=None)
    out["optim.w.step"] = torch.zeros(()) if template else full["optim.w.step"].clone()
    return out


def _save(rank: int, world: int, uri: str) -> None:
    tensors = _sharded(_full_state(), template=False)
    rows = storage.write_shards(uri, 5, rank, storage.snapshot(tensors), generation=1)
    storage.gather_and_commit(uri, 5, rows, layout={"dp_shard": world}, train_state={"step": 5}, generation=1)


def _load(rank: int, world: int, uri: str) -> dict:
    tensors = _sharded(_full_state(), template=True)
    storage.load_shards(uri, 5, tensors)
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in tensors.items()}


def test_s3_save_and_reshard(s3):
    uri = f"{s3}/job"
    storage.check_writable(uri)
    run_distributed(_save, 2, uri)
    assert [c["step"] for c in storage.list_checkpoints(uri)] == [5]
    assert storage.verify(uri, 5)["layout"] == {"dp_shard": 2}
    full = _full_state()
    for got in run_distributed(_load, 3, uri):
        assert all(torch.equal(got[k], full[k]) for k in full)


def test_s3_catalog(s3):
    uri = f"{s3}/catalog"
    state = _full_state()
    for step in (1, 2, 3):
        rows = storage.write_shards(uri, step, 0, state, generation=1)
        storage.commit(uri, step, rows, layout={}, train_state={"step": step}, generation=1)
    storage.write_shards(uri, 0, 0, state, generation=1)  # never committed
    assert storage.latest_valid(uri) == 3
    assert storage.retain(uri, 1) == [2, 1, 0]
    assert [c["step"] for c in storage.list_checkpoints(uri)] == [3]
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load_shards(uri, 3, template)
    assert all(torch.equal(template[k], state[k]) for k in state)


def _round_trip(uri: str, storage_options: dict | None) -> None:
    state = _full_state()
    storage.check_writable(uri, storage_options=storage_options)
    rows = storage.write_shards(uri, 1, 0, state, storage_options=storage_options, generation=1)
    storage.commit(uri, 1, rows, layout={}, train_state={"step": 1}, storage_options=storage_options, generation=1)
    assert storage.verify(uri, 1, storage_options=storage_options)["step"] == 1
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load_shards(uri, 1, template, storage_options=storage_options)
    assert all(torch.equal(template[k], state[k]) for k in state)


def test_s3_bulk_bytes_go_through_pyarrow(s3, monkeypatch):
    import pyarrow.fs

    store = Store(f"{s3}/backend")
    assert store.backend == "pyarrow" and isinstance(store.arrow, pyarrow.fs.S3FileSystem)
    assert Store("memory://x").backend == "fsspec" and Store("/tmp/x").backend == "os"
    data = bytes(range(256)) * 4096  # 1 MiB
    store.write("data/f.bin", [data[:1000], memoryview(data)[1000:]])
    assert store.size("data/f.bin") == len(data) and store.read("data/f.bin") == data  # s3fs sees what pyarrow wrote
    monkeypatch.setattr(storage.fs, "RANGE_CHUNK", 7000)  # chunks that start and end inside the buffers
    a, b, gap, c = bytearray(10), bytearray(300_000), bytearray(123), bytearray(50)
    got = store.read_into("data/f.bin", [(5, [a, b]), (400_000, [gap, bytearray(0)]), (len(data) - 20, [c])])
    assert got == [300_010, 123, 20]  # the last request runs past the end of the file
    assert a == data[5:15] and b == data[15:300_015] and gap == data[400_000:400_123] and c[:20] == data[-20:]
    with pytest.raises(FileNotFoundError):
        store.read_into("data/missing.bin", [(0, [bytearray(1)])])


def test_s3_explicit_storage_options_map_to_pyarrow(s3, monkeypatch):
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k)
    options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}
    assert Store(f"{s3}/explicit", options).backend == "pyarrow"
    _round_trip(f"{s3}/explicit", options)


def test_s3_unmappable_storage_option_falls_back_to_s3fs(s3):
    options = {"config_kwargs": {"connect_timeout": 30}}  # a botocore setting pyarrow has no one-to-one equivalent for
    store = Store(f"{s3}/fallback", options)
    assert store.backend == "fsspec" and store.arrow is None
    _round_trip(f"{s3}/fallback", options)


def test_s3_lease(s3):
    """One job per URI on S3 (best effort: write, wait, read back): refusal, stale take-over, release, renewal."""
    check_lease_semantics(f"{s3}/lease", ttl_s=2.5)
    check_renewal(f"{s3}/lease-renewed", ttl_s=2.5)
