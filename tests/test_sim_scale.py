"""Scale by simulation: real meshes and real local shards of ranks of 1024- and 512-rank jobs, in one process.

torch's fake process-group backend answers every collective without talking
to anyone, so one process can play any rank of a huge job (a fresh process per
rank, started from this one): it builds the 4-D
mesh, splits the pipeline, applies TP and FSDP/HSDP to the (meta) model and
we check each parameter's local shard shape and its offset in the full tensor
(what a checkpoint records) against the arithmetic below.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import traceback

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from elastic.config import ModelConfig, ParallelConfig
from elastic.layout import Layout
from elastic.model import build_model, model_spec
from strategies import parallelize

MODEL = ModelConfig(vocab_size=128, dim=64, n_layers=8, n_heads=8, ffn_dim=256, max_seq_len=32)

JOBS = {
    # 1024 ranks, HSDP: 4 replica groups of 8-way sharding, 8-way TP, 4 stages of 2 blocks.
    "1024": (Layout(pp=4, dp_replicate=4, dp_shard=8, tp=8), "1f1b"),
    # 512 ranks, plain FSDP 16-way (uneven shards: 8 TP rows over 16 ranks), interleaved: 8 stages of 1 block.
    "512": (Layout(pp=4, dp_replicate=1, dp_shard=16, tp=8), "interleaved_1f1b"),
}

# Which dim tensor parallelism splits (None: replicated over tp).
TP_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "tok_embeddings": 0, "wo": 1, "w2": 1}


def expected_local_shape(name: str, full: tuple[int, ...], layout: Layout, coords: dict[str, int]) -> tuple[int, ...]:
    """TP splits its dim evenly (config checks divisibility); FSDP then chunks dim 0 over dp_shard like torch.chunk."""
    shape = list(full)
    tp_dim = TP_DIM.get(name.split(".")[-2])
    if tp_dim is not None:
        assert shape[tp_dim] % layout.tp == 0
        shape[tp_dim] //= layout.tp
    rows, k, i = shape[0], layout.dp_shard, coords["dp_shard"]
    chunk = math.ceil(rows / k)
    shape[0] = max(0, min(chunk, rows - i * chunk))
    return tuple(shape)


def expected_offset(name: str, full: tuple[int, ...], layout: Layout, coords: dict[str, int]) -> tuple[int, ...]:
    """Where the local shard starts in the full tensor (what the checkpoint index records)."""
    offset = [0] * len(full)
    tp_dim = TP_DIM.get(name.split(".")[-2])
    rows = full[0]
    if tp_dim is not None:
        offset[tp_dim] = coords["tp"] * (full[tp_dim] // layout.tp)
        rows = full[0] // layout.tp if tp_dim == 0 else full[0]
    offset[0] += coords["dp_shard"] * math.ceil(rows / layout.dp_shard)
    return tuple(offset)


def expected_blocks(stage_ids: list[int], n_stages: int) -> set[str]:
    per = MODEL.n_layers // n_stages  # the cost balance gives equal blocks here (embedding and head are small)
    return {str(b) for s in stage_ids for b in range(s * per, (s + 1) * per)}


def _cases():
    for job, (layout, _) in JOBS.items():
        n = layout.world_size
        for rank in (0, n // 2 + n // 8 + 5, n - 1):
            yield job, rank


def check_rank(job: str, rank: int) -> None:
    """Play `rank` of `job` on the fake backend: build the mesh and the parallel model, assert its shards."""
    layout, schedule = JOBS[job]
    world = layout.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = layout.build_mesh("cpu")
        coords = layout.coords(rank)
        for axis, size in zip(mesh.mesh_dim_names, layout.shape):
            assert mesh[axis].size() == size
            assert mesh[axis].get_local_rank() == coords[axis]
        parallel = ParallelConfig(
            pp=layout.pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp, pp_schedule=schedule
        )
        pm = parallelize(build_model(MODEL), mesh, parallel, micro_batch=2, spec=model_spec(MODEL))

        virtual = parallel.pp_virtual_stages if schedule == "interleaved_1f1b" else 1
        n_stages = layout.pp * virtual
        assert pm.n_stages == n_stages
        assert pm.stage_ids == [coords["pp"] + k * layout.pp for k in range(virtual)]
        assert len(pm.model_parts) == virtual and pm.schedule is not None

        full = dict(build_model(MODEL).named_parameters())
        names = [n for n, _ in pm.named_parameters()]
        assert len(names) == len(set(names))
        blocks = {n.split(".")[1] for n in names if n.startswith("layers.")}
        assert blocks == expected_blocks(pm.stage_ids, n_stages)
        assert ("tok_embeddings.weight" in names) == (0 in pm.stage_ids)
        assert ("output.weight" in names) == ("norm.weight" in names) == (n_stages - 1 in pm.stage_ids)

        dp_axes = ("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",)
        for name, param in pm.named_parameters():
            assert isinstance(param, DTensor), name
            assert tuple(param.shape) == tuple(full[name].shape), name
            tp_sharded = TP_DIM.get(name.split(".")[-2]) is not None or name.endswith("norm.weight")
            assert param.device_mesh.mesh_dim_names == dp_axes + (("tp",) if tp_sharded else ()), name
            got = tuple(param.to_local().shape)
            want = expected_local_shape(name, tuple(full[name].shape), layout, coords)
            assert got == want, f"rank {rank} {coords}: {name} local {got}, expected {want}"
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            assert tuple(shape) == want, name
            if all(want):
                assert tuple(offset) == expected_offset(name, tuple(full[name].shape), layout, coords), name
    finally:
        dist.destroy_process_group()


def _check_in_child(case: tuple[str, int]) -> str | None:
    try:
        check_rank(*case)
    except BaseException:
        return traceback.format_exc()
    return None


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, int], str | None]:
    """One fresh process per simulated rank (DeviceMesh caches compare meshes without the rank,
    so a second rank in the same process would inherit the first one's coordinates)."""
    cases = list(_cases())
    with mp.get_context("spawn").Pool(processes=2, maxtasksperchild=1) as pool:
        return dict(zip(cases, pool.map(_check_in_child, cases, chunksize=1)))


@pytest.mark.parametrize("job,rank", list(_cases()))
def test_rank_shards_at_scale(job, rank, outcomes):
    error = outcomes[(job, rank)]
    assert error is None, error


def test_sim_covers_uneven_and_empty_shards():
    """The 512 job's last rank holds no rows of wq (8 TP rows over 16 shards): the arithmetic covers empty shards."""
    layout, _ = JOBS["512"]
    assert expected_local_shape("layers.7.attention.wq.weight", (64, 64), layout, layout.coords(layout.world_size - 1)) == (0, 64)
