"""Checkpoint benchmark: this storage vs torch.distributed.checkpoint vs raw sequential I/O, same state, same disk.

The state: 8 parameters of 4096 x 2816 fp32 with their AdamW `exp_avg` and
`exp_avg_sq` (and `step` scalars), FSDP-sharded over 4 gloo processes
(`Shard(0)` DTensors on a 1-D `dp_shard` mesh): about 1.1 GB in all, 277 MB
per process, filled with seeded random values.

1. Save (4 processes): raw (each process writes its bytes to one file,
   fsync), this storage (`write_shards` + `gather_and_commit`, which fsyncs
   every data file, the index and the manifest), DCP (`dcp.save` with
   `FileSystemWriter(sync_files=True)`, which fsyncs its files); `ROUNDS`
   rounds, the methods taking turns going first, each into an empty target.
   Then simulated training steps (forward and backward read every weight
   shard, the optimizer updates every state tensor in place): `TRAIN_STEPS`
   without a save, then `ASYNC_SAVES` steps that each start an async save with
   one `BackgroundWriter`, as the trainer does: the copy runs while forward
   and backward do, and training waits for it before the optimizer. The
   training stall (that wait) vs the synchronous save, for the first save
   (which allocates the snapshot buffers) and in the steady state (which
   reuses them), and the step time with and without a save in flight.
2. Between saves and loads every file written is evicted from this machine's
   page cache (`posix_fadvise(DONTNEED)` after the fsync: drop_caches is not
   available), and each load runs in *fresh processes*, so loads read what a
   previous process wrote, from the disk (or whatever cache the host keeps
   below this VM).
3. Load (4 fresh processes, `ROUNDS` times, the order rotating): raw (`preadv` into preallocated buffers), this
   storage (`load_shards`, every piece's CRC-32 checked), DCP (`dcp.load`).
   Every load is checked bitwise against the saved values (outside the timing).
4. Reshard load (2 fresh processes, dp_shard=4 -> 2, `ROUNDS` times): this storage and DCP.
5. Planning: the reads of all 512 ranks of two layouts, from a real checkpoint
   of a simulated 1024-rank job (`tests/test_storage_sim_scale.py`).

Figures are bytes of state / wall time of the slowest process, in GB/s (1e9),
the median of the rounds (every sample is in the JSON, `*_samples`).
Writes `bench/results/checkpoint.json` and prints the markdown table for
`bench/README.md`. Run with `make bench-checkpoint`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

N_PARAMS, ROWS = 8, 4096
COLS = int(os.environ.get("ELASTIC_BENCH_CKPT_COLS", "2816"))
"""`--quick` shrinks the state (a smoke run of the whole script); the environment carries it to the spawned ranks."""
STATES = ("model", "exp_avg", "exp_avg_sq")
SAVE_WORLD, RESHARD_WORLD = 4, 2
ROUNDS = int(os.environ.get("ELASTIC_BENCH_CKPT_ROUNDS", "3"))
"""Every figure is the median of this many runs; the three methods take turns going first (the disk's speed drifts)."""
ASYNC_SAVES = 4
"""Async saves in a row, one per training step: the first allocates the snapshot buffers, the rest show the steady-state stall."""
TRAIN_STEPS = 3
"""Simulated training steps without a save: the step time the async saves are compared with."""
TRAIN_TOKENS = int(os.environ.get("ELASTIC_BENCH_CKPT_TOKENS", "256"))
"""Tokens per rank per simulated step (the step's compute is 6 x tokens x parameters flops)."""


# -- the state ------------------------------------------------------------------------------------------
def _key(state: str, i: int) -> str:
    return f"model.layers.{i}.weight" if state == "model" else f"optim.layers.{i}.weight.{state}"


def _chunk(key: str, rank: int, world: int) -> torch.Tensor:
    """The rows of `key` that `rank` of `world` holds: the concatenation of the seeded blocks of the 4-way layout."""
    per = SAVE_WORLD // world
    parts = []
    for r in range(rank * per, (rank + 1) * per):
        g = torch.Generator().manual_seed(sum(map(ord, key)) * 1009 + r)
        parts.append(torch.empty(ROWS // SAVE_WORLD, COLS).uniform_(-1, 1, generator=g))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def make_state(rank: int, world: int, *, fill: bool) -> dict[str, torch.Tensor]:
    """The sharded state at `world` ranks: DTensors (Shard(0) over dp_shard) plus AdamW `step` scalars."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    out = {}
    for i in range(N_PARAMS):
        for state in STATES:
            key = _key(state, i)
            local = _chunk(key, rank, world) if fill else torch.empty(ROWS // world, COLS)
            out[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(ROWS, COLS), stride=(COLS, 1))
        out[f"optim.layers.{i}.weight.step"] = torch.tensor(float(100 + i)) if fill else torch.zeros(())
    return out


def state_bytes() -> int:
    return N_PARAMS * (len(STATES) * ROWS * COLS * 4 + 4)


def check_state(state: dict, rank: int, world: int) -> None:
    """Bitwise: the loaded state is the saved one."""
    want = make_state(rank, world, fill=True)
    for key, t in state.items():
        got = t.to_local() if hasattr(t, "to_local") else t
        exp = want[key].to_local() if hasattr(want[key], "to_local") else want[key]
        if not torch.equal(got.view(torch.int32), exp.view(torch.int32)):
            raise AssertionError(f"rank {rank}/{world}: {key} differs after the load")


# -- raw sequential I/O of the same bytes -------------------------------------------------------------------
def _raw_buffers(state: dict) -> list:
    return [(t.to_local() if hasattr(t, "to_local") else t).reshape(-1).view(torch.uint8).numpy() for _, t in sorted(state.items())]


def raw_save(path: Path, state: dict) -> None:
    with open(path, "wb", buffering=0) as f:
        for buf in _raw_buffers(state):
            mv = memoryview(buf)
            while mv:
                mv = mv[f.write(mv):]
        os.fsync(f.fileno())
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def raw_load(path: Path, state: dict) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        bufs = _raw_buffers(state)
        pos = 0
        for buf in bufs:
            mv = memoryview(buf)
            while mv:
                n = os.preadv(fd, [mv], pos)
                if n <= 0:
                    raise EOFError(path)
                pos += n
                mv = mv[n:]
    finally:
        os.close(fd)


def evict(root: Path) -> None:
    """Drop every file under `root` from the page cache (they are fsynced, so their pages are clean)."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -- the phases (run on every rank) ---------------------------------------------------------------------------
def _timed(fn) -> float:
    """Wall time of `fn` across all ranks: barrier, run, barrier (the slowest rank decides)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _slowest(values: list[float]) -> list[float]:
    """Element-wise maximum over the ranks: a step is as slow as its slowest rank."""
    gathered = [torch.zeros(len(values), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor(values, dtype=torch.float64))
    return torch.stack(gathered).max(0).values.tolist()


def _train_step(state: dict, x: torch.Tensor, writer) -> tuple[float, float]:
    """One simulated training step on this rank's shards; returns (its seconds, the seconds it waited for a snapshot).

    Forward and backward read every weight shard (per layer: `x @ W.T`, then
    the input and weight gradients: 6 x tokens x parameters flops, as a real
    step); the optimizer then updates every state tensor in place without
    changing its value (`+ 0 * grad`, `* 1`), so the loads still check against
    the saved values. With a `writer`, training waits for the save's copy just
    before the optimizer, as the trainer does.
    """
    t0 = time.perf_counter()
    grads = {}
    for i in range(N_PARAMS):
        w = state[_key("model", i)].to_local()
        gy = x @ w.T
        gy.matmul(w)  # the input's gradient
        grads[i] = gy.T @ x
    stall = writer.wait_snapshot() if writer is not None else 0.0
    for i in range(N_PARAMS):
        state[_key("model", i)].to_local().add_(grads[i], alpha=0.0)
        state[_key("exp_avg", i)].to_local().mul_(1.0)
        state[_key("exp_avg_sq", i)].to_local().mul_(1.0)
    return time.perf_counter() - t0, stall


def _rotated(r: int) -> list[str]:
    """The order of the three methods in round `r`: each goes first, second and third in turn."""
    methods = ["raw", "ours", "dcp"]
    return methods[r % 3 :] + methods[: r % 3]


def _ours_step(root: Path) -> int:
    import storage

    return storage.list_checkpoints(str(root / "ours"))[0]["step"]


def phase_save(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import storage

    root = Path(root)
    state = make_state(rank, world, fill=True)
    layout = {"pp": 1, "dp_replicate": 1, "dp_shard": world, "tp": 1}
    (root / "raw").mkdir(exist_ok=True)
    out = {"disk_write_s_samples": [], "save_s_samples": [], "dcp_save_s_samples": []}
    step = 0

    def ours(step: int) -> None:
        rows = storage.write_shards(str(root / "ours"), step, rank, state, generation=0)
        storage.gather_and_commit(str(root / "ours"), step, rows, layout=layout, train_state={"step": step}, generation=0)

    for r in range(ROUNDS):
        for method in _rotated(r):
            if rank == 0:  # every save starts from an empty target (the barrier in _timed waits for this)
                if method == "raw":
                    for f in (root / "raw").iterdir():
                        f.unlink()
                else:
                    shutil.rmtree(root / method, ignore_errors=True)
            step += 1
            if method == "raw":
                out["disk_write_s_samples"].append(_timed(lambda: raw_save(root / "raw" / f"rank{rank}.bin", state)))
            elif method == "ours":
                out["save_s_samples"].append(_timed(lambda: ours(step)))  # noqa: B023 - called at once
            else:
                writer = dcp.FileSystemWriter(str(root / "dcp"), sync_files=True)
                out["dcp_save_s_samples"].append(_timed(lambda: dcp.save(state, storage_writer=writer)))  # noqa: B023

    # async, as in training: every step submits a save of the state its optimizer step left, runs forward and
    # backward while the writer thread copies, waits for the copy (the stall), then steps the optimizer. The
    # first save allocates the snapshot buffers, the later ones reuse them (steady state).
    writer = storage.BackgroundWriter()
    x = torch.randn(TRAIN_TOKENS, COLS, generator=torch.Generator().manual_seed(rank))
    out["train_step_s_samples"] = [_train_step(state, x, None)[0] for _ in range(TRAIN_STEPS)]
    out["async_stalls_s"], out["async_step_s_samples"], out["async_write_s"] = [], [], []
    saves = []
    for _ in range(ASYNC_SAVES):
        step += 1
        t0 = time.perf_counter()
        future = writer.submit(str(root / "ours"), step, rank, state, generation=0)
        future.add_done_callback(lambda _f, t0=t0: out["async_write_s"].append(time.perf_counter() - t0))
        step_s, stall = _train_step(state, x, writer)
        out["async_step_s_samples"].append(step_s)
        out["async_stalls_s"].append(stall)
        saves.append((step, future))
    for step, future in saves:  # the coordinator's part, after the steps: the commit is not the trainer's stall
        storage.gather_and_commit(str(root / "ours"), step, future.result(), layout=layout, train_state={"step": step}, generation=0)
    writer.close()  # joins the writer thread: every done-callback has run
    for name in ("train_step_s_samples", "async_stalls_s", "async_step_s_samples", "async_write_s"):
        out[name] = _slowest(out[name])
    dist.barrier()
    if rank == 0:
        storage.retain(str(root / "ours"), 1)  # the last async save is the same state; the loads use it
        evict(root)
    dist.barrier()
    return out


def _load_all(rank: int, world: int, root: str, methods: list[str], keys: dict[str, str]) -> dict:
    """Load the saved state with each method (fresh destination tensors each), timed and checked bitwise."""
    import torch.distributed.checkpoint as dcp

    import storage

    root = Path(root)
    step = _ours_step(root)
    loaders = {
        "raw": lambda state: raw_load(root / "raw" / f"rank{rank}.bin", state),
        "ours": lambda state: storage.load_shards(str(root / "ours"), step, state),
        "dcp": lambda state: dcp.load(state, storage_reader=dcp.FileSystemReader(str(root / "dcp"))),
    }
    out = {}
    for method in methods:
        state = make_state(rank, world, fill=False)
        out[keys[method]] = _timed(lambda: loaders[method](state))  # noqa: B023
        check_state(state, rank, world)
    dist.barrier()
    if rank == 0:
        evict(root)
    dist.barrier()
    return out


def phase_load(rank: int, world: int, root: str, r: int = 0) -> dict:
    return _load_all(rank, world, root, _rotated(r), {"raw": "disk_read_s", "ours": "load_s", "dcp": "dcp_load_s"})


def phase_reshard(rank: int, world: int, root: str, r: int = 0) -> dict:
    methods = ["ours", "dcp"] if r % 2 == 0 else ["dcp", "ours"]
    return _load_all(rank, world, root, methods, {"ours": "reshard_load_s", "dcp": "dcp_reshard_load_s"})


# -- process harness ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, phase: str, root: str, r: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    try:
        result = PHASES[phase](rank, world, root) if phase == "save" else PHASES[phase](rank, world, root, r)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(out_dir, f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


PHASES = {"save": phase_save, "load": phase_load, "reshard": phase_reshard}


def run_phase(phase: str, world: int, root: str, r: int = 0) -> dict:
    """Run a phase on `world` fresh processes; returns rank 0's figures (all ranks time the same barriers)."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_entry, args=(world, _free_port(), out_dir, phase, root, r), nprocs=world, start_method="spawn")
        except Exception as exc:
            errors = sorted(Path(out_dir).glob("*.err"))
            raise RuntimeError(f"phase {phase} failed: {exc}\n{errors[0].read_text() if errors else ''}") from None
        return json.loads(Path(out_dir, "0.json").read_text())


def plan_512_ranks() -> dict:
    """Plan the reads of all 512 ranks of both target layouts of the 1024-rank simulation (see its test)."""
    import test_storage_sim_scale as sim

    saved, loads = sim.FULL
    result = sim.simulate(saved, loads, check_data=False)
    per_layout = {str(layout): round(result[str(layout)]["plan_s"], 4) for layout in loads}
    return {"plan_512_ranks_s": max(per_layout.values()), "plan_512_ranks_by_layout_s": per_layout,
            "sim_checkpoint_rows": result["rows"], "sim_checkpoint_files": result["files"]}


def machine(root: Path) -> dict:
    usage = shutil.disk_usage(root)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "memory_gib": round(mem / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "bench_dir": str(root),
            "disk_total_gib": round(usage.total / 2**30), "load_average_at_start": list(os.getloadavg())}


def table(r: dict) -> str:
    g = lambda k: f"{r[k]:.3f}"  # noqa: E731
    lines = [
        f"State: {r['bytes'] / 1e9:.2f} GB (FSDP dp_shard={SAVE_WORLD}: {N_PARAMS} params {ROWS}x{COLS} fp32 + AdamW state), "
        f"{r['machine']['cpus']} CPUs, load average {r['machine']['load_average_at_start'][0]:.1f} at start; "
        f"each figure the median of {r['rounds']} runs, the methods taking turns going first.",
        "",
        "| GB/s (higher is better) | this storage | torch DCP | raw disk |",
        "|---|---|---|---|",
        f"| save, 4 processes, fsynced | {g('save_gbps')} | {g('dcp_save_gbps')} | {g('disk_write_gbps')} |",
        f"| load, 4 fresh processes | {g('load_gbps')} | {g('dcp_load_gbps')} | {g('disk_read_gbps')} |",
        f"| load at 2 processes (reshard 4 -> 2) | {g('reshard_load_gbps')} | {g('dcp_reshard_load_gbps')} | |",
        "",
        "| seconds | |",
        "|---|---|",
        f"| synchronous save | {r['sync_save_s']:.2f} |",
        (
            f"| async save: training stall, steady state (saves 2-{len(r['async_stalls_s'])}, median) | {1000 * r['async_stall_s']:.2f} ms "
            f"({100 * r['async_stall_s'] / r['sync_save_s']:.2f}% of a synchronous save) |"
        ),
        (
            f"| async save: training stall, first save (allocates the snapshot buffers) | {1000 * r['async_first_stall_s']:.2f} ms "
            f"({100 * r['async_first_stall_s'] / r['sync_save_s']:.2f}%) |"
        ),
        f"| async save: until written, in the background (steady state) | {r['async_write_s_median']:.2f} |",
        f"| simulated training step ({TRAIN_TOKENS} tokens per rank), no save | {r['train_step_s']:.2f} |",
        (
            f"| the same step with an async save in flight (steady state) | {r['async_step_s']:.2f} "
            f"(+{100 * (r['async_step_s'] / r['train_step_s'] - 1):.0f}%: the copy and the write share the CPUs) |"
        ),
        f"| plan the reads of all 512 ranks (1024-rank checkpoint) | {r['plan_512_ranks_s']:.3f} |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir under /tmp)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint.json"))
    parser.add_argument("--quick", action="store_true", help="a smoke run: a 36 MB state, no planning figure, result to /tmp")
    args = parser.parse_args()
    if args.quick:
        os.environ["ELASTIC_BENCH_CKPT_COLS"] = "96"
        globals()["COLS"] = 96
        args.out = os.path.join(tempfile.gettempdir(), "checkpoint-quick.json")
    base = Path(tempfile.mkdtemp(prefix="elastic-bench-ckpt-", dir=args.dir))
    started = time.perf_counter()
    try:
        result = {"bytes": state_bytes(), "machine": machine(base)}
        print(f"state {result['bytes'] / 1e9:.2f} GB in {base}", flush=True)
        result.update(run_phase("save", SAVE_WORLD, str(base)))
        print("saved", flush=True)
        for r in range(ROUNDS):  # fresh processes every time: each load reads what an earlier process wrote
            for k, v in run_phase("load", SAVE_WORLD, str(base), r).items():
                result.setdefault(f"{k}_samples", []).append(v)
        print("loaded", flush=True)
        for r in range(ROUNDS):
            for k, v in run_phase("reshard", RESHARD_WORLD, str(base), r).items():
                result.setdefault(f"{k}_samples", []).append(v)
        print("resharded", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result.update(plan_512_ranks() if not args.quick else {"plan_512_ranks_s": float("nan")})
    b = result["bytes"]
    for name in ("save", "dcp_save", "disk_write", "load", "dcp_load", "disk_read", "reshard_load", "dcp_reshard_load"):
        result[f"{name}_s"] = statistics.median(result[f"{name}_s_samples"])
        result[f"{name}_gbps"] = b / result[f"{name}_s"] / 1e9
    result["sync_save_s"] = result["save_s"]
    result["async_first_stall_s"] = result["async_stalls_s"][0]
    result["async_stall_s"] = statistics.median(result["async_stalls_s"][1:])  # steady state: buffers reused
    result["async_write_s_median"] = statistics.median(result["async_write_s"][1:])
    result["train_step_s"] = statistics.median(result["train_step_s_samples"])
    result["async_step_s"] = statistics.median(result["async_step_s_samples"][1:])
    result["rounds"] = ROUNDS
    result["bench_wall_s"] = time.perf_counter() - started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(table(result))
    print(f"wrote {args.out} ({result['bench_wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
