"""1024 ranks onto 512, by simulation: a real checkpoint written by every rank of a huge job, loaded at two others.

The job is `pp=4, dp_replicate=4, dp_shard=8, tp=8` (1024 ranks) with a small
model and its AdamW state (`exp_avg`, `exp_avg_sq`, `step`): real bytes,
every tensor filled with its own deterministic values. One process plays every
rank:

1. *Placements from the real model.* For each pipeline stage of each layout a
   fresh process (torch's fake process-group backend; a process per rank,
   because the device-mesh caches go wrong when the fake group is
   re-initialised in one process) builds the named mesh, parallelizes the
   model (TP, FSDP/HSDP, pipeline split) and reports every parameter's mesh
   and placements. The same process proves the simulation right for its rank:
   after `load_full_state` (torch's own `distribute_tensor` slicing), every
   parameter's real local shard equals what the simulation computes from
   `storage.boxes`, and `storage`'s writer choice on the live DTensors picks
   exactly the pieces the simulation has that rank write.
2. *Save.* For every rank: its local shards from the placement arithmetic, the
   pieces it is the one writer of, `write_shards`; then one `commit`. Every
   piece is written exactly once, and the writing is spread over the ranks.
3. *Load.* One `ReadPlanner` decodes the index once and plans the reads of all
   512 ranks of `pp=4, dp_replicate=2, dp_shard=8, tp=8` and of
   `pp=2, dp_replicate=1, dp_shard=64, tp=4` (most shards there are empty or
   uneven); the time is printed. Then every rank loads (`load_into`, checksums
   checked) and every local tensor is compared bitwise with the slice of the
   full tensor it must hold.

The full version is `slow`; the default suite runs the same on a
128-rank job loaded at 64 ranks (`pp=2, dp_replicate=2, dp_shard=4, tp=8` →
`pp=2, dp_shard=4, tp=8` and `dp_shard=16, tp=4`).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import time
import traceback
import zlib
from contextlib import contextmanager

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

import storage
from elastic.config import ModelConfig, ParallelConfig
from elastic.layout import AXES, Layout
from storage.boxes import Box, local_boxes, local_runs, split_rows
from storage.reader import ReadPlanner, load_into
from storage.state import PIECE_BYTES, LocalPart, is_writer, local_view

MODEL = ModelConfig(vocab_size=128, dim=64, n_layers=8, n_heads=8, ffn_dim=256, max_seq_len=32)
OPTIM_STATES = ("exp_avg", "exp_avg_sq")
"""AdamW state shaped and placed like its parameter; `step` is a plain scalar on every rank of the parameter's mesh."""

FULL = (Layout(pp=4, dp_replicate=4, dp_shard=8, tp=8),
        (Layout(pp=4, dp_replicate=2, dp_shard=8, tp=8), Layout(pp=2, dp_replicate=1, dp_shard=64, tp=4)))
SHORT = (Layout(pp=2, dp_replicate=2, dp_shard=4, tp=8),
         (Layout(pp=2, dp_replicate=1, dp_shard=4, tp=8), Layout(pp=1, dp_replicate=1, dp_shard=16, tp=4)))
STEP = 7


# -- the full training state ---------------------------------------------------------
def full_state() -> dict[str, torch.Tensor]:
    """Every tensor of the job's training state, full size, with values of its own (seeded by its name)."""
    from elastic.model import build_model

    out = {}
    for name, param in build_model(MODEL).named_parameters():
        for key, kind in ((f"model.{name}", "n"), (f"optim.{name}.exp_avg", "n"), (f"optim.{name}.exp_avg_sq", "u")):
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            t = torch.randn(param.shape, generator=g) if kind == "n" else torch.rand(param.shape, generator=g)
            out[key] = t
        out[f"optim.{name}.step"] = torch.tensor(float(zlib.crc32(name.encode()) % 1000))
    return out


# -- placements, as JSON -----------------------------------------------------------------
def _encode(p) -> list:
    if isinstance(p, _StridedShard):
        return ["strided", p.dim, int(p.split_factor)]
    if isinstance(p, Shard):
        return ["shard", p.dim]
    if isinstance(p, Replicate):
        return ["replicate"]
    raise TypeError(f"unexpected placement {p}")


def _decode(e: list):
    return {"strided": lambda: _StridedShard(e[1], split_factor=e[2]), "shard": lambda: Shard(e[1]),
            "replicate": Replicate}[e[0]]()


_DECODED: dict[tuple, list] = {}


def _placements(encoded: list) -> list:
    key = tuple(map(tuple, encoded))
    if key not in _DECODED:
        _DECODED[key] = [_decode(e) for e in encoded]
    return _DECODED[key]


# -- one rank, by arithmetic ---------------------------------------------------------------
def rank_state(specs: dict, layout: Layout, rank: int, full: dict | None) -> dict[str, tuple]:
    """What `rank` of `layout` holds: {key: (global shape, local tensor, boxes, writes it)}.

    Without `full` only the boxes are computed (local None, writes False): what planning a load needs.

    `specs` are the parameters of the rank's pipeline stage with their mesh and
    placements; the boxes come from `storage.boxes.local_boxes` and the writer
    choice from `storage.state.is_writer`, the same code a live save uses.
    """
    coords = layout.coords(rank)
    out = {}
    for name, spec in specs.items():
        shape, names = tuple(spec["shape"]), spec["mesh"]
        mesh_shape = [getattr(layout, a) for a in names]
        mesh_coords = [coords[a] for a in names]
        placements = _placements(spec["placements"])
        boxes = local_boxes(shape, mesh_shape, mesh_coords, placements)
        sharded = [isinstance(p, (Shard, _StridedShard)) for p in placements]
        outside = [(getattr(layout, a), coords[a]) for a in AXES if a not in names and a != "pp"]
        replicas = outside + [(s, c) for s, c, sh in zip(mesh_shape, mesh_coords, sharded) if not sh]
        shard_coords = [c for c, sh in zip(mesh_coords, sharded) if sh]
        for key in (f"model.{name}", *(f"optim.{name}.{s}" for s in OPTIM_STATES)):
            local = None
            if full is not None:
                local_shape = [sum(n for _, n in runs) for runs in local_runs(shape, mesh_shape, mesh_coords, placements)]
                local = torch.empty(local_shape, dtype=full[key].dtype)
                for box in boxes:
                    src = full[key]
                    for d, (o, n) in enumerate(zip(box.offsets, box.lengths)):
                        src = src.narrow(d, o, n)
                    local_view(local, box).copy_(src)
            out[key] = (shape, local, boxes, full is not None and is_writer(key, shard_coords, replicas))
        key = f"optim.{name}.step"
        everyone = outside + list(zip(mesh_shape, mesh_coords))
        writes = full is not None and is_writer(key, [], everyone)
        out[key] = ((), None if full is None else full[key].clone(), [Box((), (), ())], writes)
    return out


def written_parts(state: dict[str, tuple]) -> dict[str, LocalPart]:
    """The pieces a rank writes (cut like a live save cuts them), as `write_shards` takes them."""
    out = {}
    for key, (shape, local, boxes, writes) in state.items():
        pieces = []
        if writes:
            for box in boxes:
                pieces.extend((b, local_view(local, b)) for b in split_rows(box, local.element_size(), PIECE_BYTES))
        out[key] = LocalPart(shape, local.dtype, pieces)
    return out


# -- one rank, for real (a fresh process on the fake backend) ------------------------------------
def probe_rank(shape: tuple[int, int, int, int], rank: int) -> str:
    """Build `rank` of the layout for real; return its parameters' placements, checked against the simulation (JSON)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from elastic.model import build_model, model_spec
    from storage.state import plan_writes
    from strategies import load_full_state, parallelize

    layout = Layout(*shape)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        mesh = layout.build_mesh("cpu")
        pm = parallelize(build_model(MODEL), mesh, ParallelConfig(**layout.as_dict()), micro_batch=2, spec=model_spec(MODEL))
        pm.materialize("cpu")
        full = full_state()
        load_full_state(pm, {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")})
        params = dict(pm.named_parameters())
        specs = {
            name: {"shape": list(p.shape), "mesh": list(p.device_mesh.mesh_dim_names), "placements": [_encode(x) for x in p.placements]}
            for name, p in params.items()
        }
        sim = rank_state(specs, layout, rank, full)
        live = {}
        for name, p in params.items():
            real, want = p.to_local(), sim[f"model.{name}"][1]
            assert tuple(real.shape) == tuple(want.shape) and torch.equal(real, want), f"rank {rank}: {name} differs from the simulation"
            live[f"model.{name}"] = p
            for s in OPTIM_STATES:
                live[f"optim.{name}.{s}"] = p  # same placements as the parameter: only boxes and writer choice matter here
            live[f"optim.{name}.step"] = torch.zeros(())
        simulated = written_parts({key: sim[key] for key in live})
        for key, part in plan_writes(live).items():
            got = [(b.offsets, b.lengths) for b, _ in part.pieces]
            want_boxes = [(b.offsets, b.lengths) for b, _ in simulated[key].pieces]
            assert got == want_boxes, f"rank {rank}: storage writes {got} of {key}, the simulation {want_boxes}"
        return json.dumps({"rank": rank, "specs": specs})
    finally:
        dist.destroy_process_group()


def _probe_in_child(case) -> str:
    try:
        return probe_rank(*case)
    except BaseException:
        return json.dumps({"error": traceback.format_exc()})


def probe_ranks(layouts: list[Layout]) -> dict[Layout, dict[int, dict]]:
    """Per layout, per pipeline stage: the stage's parameter specs, from a real rank of that stage (one process each).

    The probed rank of stage s has uneven coordinates (the last dp_replicate,
    a middle dp_shard and tp), so the real-vs-simulated check covers more than rank 0.
    """
    cases = []
    for layout in layouts:
        for s in range(layout.pp):
            rank = layout.rank_of(pp=s, dp_replicate=layout.dp_replicate - 1, dp_shard=(layout.dp_shard * 3 + s) // 4 % layout.dp_shard,
                                  tp=(layout.tp // 2 + s) % layout.tp)
            cases.append((layout.shape, rank))
    with mp.get_context("spawn").Pool(processes=2, maxtasksperchild=1) as pool:
        results = pool.map(_probe_in_child, cases, chunksize=1)
    out: dict[Layout, dict[int, dict]] = {}
    for (shape, rank), text in zip(cases, results):
        got = json.loads(text)
        assert "error" not in got, got.get("error")
        layout = Layout(*shape)
        out.setdefault(layout, {})[layout.coords(rank)["pp"]] = got["specs"]
    return out


# -- save and load every rank ----------------------------------------------------------------------
def save_all(uri: str, layout: Layout, stage_specs: dict[int, dict], full: dict) -> dict:
    """Every rank of `layout` writes its pieces; one commit. Returns the manifest."""
    rows = []
    for rank in range(layout.world_size):
        state = rank_state(stage_specs[layout.coords(rank)["pp"]], layout, rank, full)
        rows += storage.write_shards(uri, STEP, rank, written_parts(state), generation=1)
    return storage.commit(uri, STEP, rows, layout=layout.as_dict(), train_state={"step": STEP, "cursor": 1234}, generation=1)


def plan_all(planner: ReadPlanner, layout: Layout, stage_specs: dict[int, dict]) -> int:
    """Plan the reads of every rank of `layout` (boxes and overlaps, no data); returns the number of reads."""
    reads = 0
    for rank in range(layout.world_size):
        state = rank_state(stage_specs[layout.coords(rank)["pp"]], layout, rank, None)
        plan = planner.plan({key: (shape, torch.float32, boxes) for key, (shape, _, boxes, _) in state.items()})
        reads += sum(len(groups) for groups in plan.values())
    return reads


def load_and_check_all(uri: str, planner: ReadPlanner, layout: Layout, stage_specs: dict[int, dict], full: dict) -> int:
    """Every rank of `layout` loads its shards; each must equal, bit for bit, its slice of the full tensors."""
    checked = 0
    for rank in range(layout.world_size):
        want = rank_state(stage_specs[layout.coords(rank)["pp"]], layout, rank, full)
        targets = {}
        for key, (shape, local, boxes, _) in want.items():
            targets[key] = (shape, torch.full_like(local, float("nan")), boxes)
        manifest = load_into(uri, STEP, targets, planner=planner)
        assert manifest["train_state"] == {"step": STEP, "cursor": 1234}
        for key, (_, got, _) in targets.items():
            expected = want[key][1]
            assert got.shape == expected.shape and torch.equal(got.view(torch.int32), expected.view(torch.int32)), (
                f"{layout} rank {rank}: {key} is not bit-exact"
            )
            checked += got.numel()
    return checked


@contextmanager
def scratch_dir():
    """Real files on tmpfs where there is one (fsync is free there), else the temp dir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="elastic-sim-ckpt-", dir=base) as d:
        yield d


def simulate(saved: Layout, loads: tuple[Layout, ...], *, check_data: bool = True) -> dict:
    """The whole scenario; returns timings and counts (also used by bench/checkpoint.py for the planning figure)."""
    specs = probe_ranks([saved, *loads])
    full = full_state()
    out: dict = {}
    with scratch_dir() as root:
        uri = f"{root}/ckpt"
        t0 = time.perf_counter()
        manifest = save_all(uri, saved, specs[saved], full)
        out["save_s"] = time.perf_counter() - t0
        out["files"], out["bytes"] = len(manifest["files"]), manifest["bytes"]
        out["rows"] = manifest["index"]["rows"]
        storage.verify(uri, STEP)
        for layout in loads:
            t0 = time.perf_counter()
            planner = ReadPlanner.open(uri, STEP)
            reads = plan_all(planner, layout, specs[layout])
            plan_s = time.perf_counter() - t0
            out[str(layout)] = {"ranks": layout.world_size, "plan_s": plan_s, "reads": reads}
            print(f"planned the reads of all {layout.world_size} ranks of {layout} in {plan_s:.3f} s ({reads} coalesced reads)")
            if check_data:
                t0 = time.perf_counter()
                out[str(layout)]["elements"] = load_and_check_all(uri, planner, layout, specs[layout], full)
                out[str(layout)]["load_s"] = time.perf_counter() - t0
    return out


def _check(saved: Layout, loads, result: dict, full: dict) -> None:
    total = sum(t.numel() for t in full.values())
    assert result["bytes"] >= total * 4  # every element stored once (plus alignment padding)
    assert result["files"] >= saved.world_size // 8, "replicated pieces must be spread over many writers"
    for layout in loads:
        got = result[str(layout)]
        # every loaded element checked; replicated tensors are loaded on each replica
        assert got["elements"] >= total
        assert got["plan_s"] < 10.0, f"planning {layout.world_size} ranks took {got['plan_s']:.2f} s"


def test_sim_checkpoint_128_to_64():
    saved, loads = SHORT
    result = simulate(saved, loads)
    _check(saved, loads, result, full_state())


@pytest.mark.slow
def test_sim_checkpoint_1024_to_512():
    saved, loads = FULL
    result = simulate(saved, loads)
    _check(saved, loads, result, full_state())
    for layout in loads:
        assert result[str(layout)]["ranks"] == 512
