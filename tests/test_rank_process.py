"""A rank process's training thread outlives its generation while the next gives the process the same seat.

Why it may (`elastic.rank_process._TrainingThread`): a later generation's
meshes compare equal to the earlier ones and find their process groups by
name, which torch hands out afresh, in the same order, after
`destroy_process_group`; so what DTensor kept from the first generation in
that thread still answers right on the new groups. The first test checks that
on real gloo groups, so that a torch upgrade that breaks it fails here; the
others check which generations share a thread.
"""

from __future__ import annotations

from datetime import timedelta

from tests.distributed import free_port, run_distributed


def _sharded_matmul(mesh):
    """A row-sharded matmul whose result is gathered: sharding propagation plus a collective on `mesh`'s group."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    w = torch.linspace(-1, 1, 12).reshape(4, 3)
    y = distribute_tensor(x, mesh, [Shard(0)]) @ distribute_tensor(w, mesh, [Replicate()])
    return (y.relu() * 2).redistribute(mesh, [Replicate()]).to_local(), (x @ w).relu() * 2


def _two_generations(rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    first, expected = _sharded_matmul(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    dist.destroy_process_group()  # the generation ends; the next joins a new group
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("gen1", store), rank=rank, world_size=world)
    second, _ = _sharded_matmul(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))  # same thread, new group
    return {"first": first, "second": second, "expected": expected}


def test_a_later_generation_in_the_same_thread_computes_right_on_its_new_groups():
    for r in run_distributed(_two_generations, 2, free_port()):
        assert r["first"].equal(r["expected"]) and r["second"].equal(r["expected"])


def _runtime():
    from elastic.rank_process import RankRuntime

    return RankRuntime(lambda message: None)


def _start(runtime, rank: int, dp_shard: int = 2, generation: int = 0):
    """Start a generation whose rendezvous store is not there: its loop fails at once and reports the error."""
    from elastic.messages import Start

    spec = {"config": {}, "layout": {"pp": 1, "dp_replicate": 1, "dp_shard": dp_shard, "tp": 1}, "rank": rank,
            "generation": generation}
    runtime.start(Start(spec, "127.0.0.1", free_port(), 0.2))
    runtime._done.wait(30)
    assert runtime._error is not None  # it ran, in the thread below, and ended


def test_a_generation_in_the_same_seat_reuses_the_training_thread_and_another_seat_gets_a_new_one():
    from elastic.messages import Reset

    runtime = _runtime()
    _start(runtime, rank=1)
    first = runtime._thread
    assert runtime.reset(Reset(1.0))
    _start(runtime, rank=1, generation=1)
    assert runtime._thread is first and first.name == "train-g1-r1"
    assert runtime.reset(Reset(1.0))
    _start(runtime, rank=0, generation=2)  # another coordinate on an equal mesh: stale answers, so a new thread
    assert runtime._thread is not first
    first.join(10)
    assert not first.is_alive()  # the retired thread ends
    second = runtime._thread
    assert runtime.reset(Reset(1.0))
    _start(runtime, rank=0, dp_shard=4, generation=3)  # another layout
    assert runtime._thread is not second


def test_an_agent_gives_each_warm_process_the_rank_it_trained_last():
    import subprocess

    from elastic.agent import _Child, _sticky

    def child(last_rank):
        return _Child(proc=subprocess.Popen(["true"]), conn=None, gpus=[], last_rank=last_rank)

    # rank 1 died: its survivors (last 0, 2, 3) and a fresh spare (None) take ranks 0-3 of the replacement world
    idle = [child(0), child(2), child(3), child(None)]
    assert [c.last_rank for c in _sticky(idle, [0, 1, 2, 3])] == [0, None, 2, 3]
    # a smaller world: the ranks that are left stay where they were, in order
    assert [c.last_rank for c in _sticky(idle, [0, 1])] == [0, 2]
    for c in idle:
        c.proc.wait()
