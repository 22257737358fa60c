"""The CUDA paths: an NCCL group, FSDP on a GPU, checkpoints from GPU memory, the agent's GPU per rank.

Skipped where torch sees no GPU (CI has none). On a GPU machine:

    python -m pytest tests/test_gpu.py -v

The first two tests run in this process on a one-rank NCCL group; the last
three start an embedded Ray cluster with one GPU and run the real agent and
real jobs on it (the ranks use NCCL and FSDP's bf16 mixed precision), one of
them with the memory tier, whose snapshots are copied to pinned host memory
on a side stream.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 4


@pytest.fixture(scope="module")
def nccl():
    """A one-rank NCCL default group on 127.0.0.1, for the tests that run in this process."""
    import torch.distributed as dist

    from distributed import free_port

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist
    dist.destroy_process_group()


def test_one_rank_nccl_group_runs_the_collectives_training_uses(nccl):
    assert nccl.get_backend() == "nccl"
    x = torch.arange(4, dtype=torch.float32, device="cuda")
    nccl.all_reduce(x)
    out = torch.empty(4, device="cuda")
    nccl.all_gather_into_tensor(out, x)
    nccl.broadcast(x, src=0)
    nccl.barrier()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.arange(4, dtype=torch.float32))


def _train(pm, optimizer, batches, scale):
    from strategies import clip_grad_norm

    losses = []
    for inputs, labels in batches:
        losses.append(float(pm.forward_backward(inputs.cuda(), labels.cuda(), scale)))
        clip_grad_norm(pm, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _gpu_model(cfg, layout, mp_policy=None):
    from elastic.model import build_model, model_spec
    from strategies import parallelize

    pm = parallelize(build_model(cfg.model), layout.build_mesh("cuda"), cfg.parallel, micro_batch=cfg.training.micro_batch,
                     spec=model_spec(cfg.model), mp_policy=mp_policy)
    pm.materialize("cuda")
    return pm, torch.optim.AdamW(pm.parameters(), lr=cfg.training.lr, foreach=True)


def test_fsdp_trains_on_the_gpu_and_its_checkpoint_loads_bit_exact_on_gpu_and_cpu(nccl, tmp_path):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import storage
    from ckpt_utils import full_tensors
    from elastic.config import load_config
    from elastic.layout import Layout
    from elastic.model import build_model, model_spec
    from strategies import initial_state, load_full_state, token_loss_sum

    cfg = load_config("deploy/examples/demo.yaml", ["parallel.dp_shard=1", "scaling.num_workers=1", "scaling.min_workers=1"])
    layout = Layout()
    full = initial_state(build_model(cfg.model), model_spec(cfg.model), cfg.training.seed)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (STEPS, 8, cfg.data.seq_len + 1), generator=gen)
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    scale = 1.0 / (8 * cfg.data.seq_len)

    # fp32 FSDP on the GPU follows a plain fp32 model on the CPU; the default (bf16) policy trains too.
    pm, opt = _gpu_model(cfg, layout, MixedPrecisionPolicy())
    load_full_state(pm, full)
    gpu_losses = _train(pm, opt, batches, scale)
    ref = build_model(cfg.model).to_empty(device="cpu")
    ref.load_state_dict(full)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=cfg.training.lr, foreach=True)
    cpu_losses = []
    for inputs, labels in batches:
        loss = token_loss_sum(ref(inputs), labels)
        (loss * scale).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        cpu_losses.append(loss.item() * scale)
    gpu_mean = [v * scale for v in gpu_losses]
    assert max(abs(a - b) / abs(b) for a, b in zip(gpu_mean, cpu_losses)) < 1e-4, (gpu_mean, cpu_losses)

    bf16, bf16_opt = _gpu_model(cfg, layout)
    load_full_state(bf16, full)
    bf16_losses = [v * scale for v in _train(bf16, bf16_opt, batches * 3, scale)]
    assert next(bf16.model_parts[0].parameters()).dtype == torch.float32  # sharded master weights stay fp32
    assert all(abs(a - b) / b < 0.02 for a, b in zip(bf16_losses, cpu_losses)), (bf16_losses, cpu_losses)
    assert bf16_losses[-1] < bf16_losses[0]

    # Save from GPU memory (the snapshot copies to pinned host memory), commit, load back.
    uri = str(tmp_path / "ckpt")
    live = storage.state_tensors(pm.model_parts, opt)
    assert all(t.is_cuda for k, t in live.items() if not k.endswith(".step")), [k for k, t in live.items() if not t.is_cuda]
    rows = storage.write_shards(uri, STEPS, 0, storage.snapshot(live), generation=1)
    storage.commit(uri, STEPS, rows, layout=layout.as_dict(), train_state={"step": STEPS}, generation=1)
    fresh, fresh_opt = _gpu_model(cfg, layout, MixedPrecisionPolicy())
    storage.load_training_state(uri, STEPS, fresh.model_parts, fresh_opt)
    loaded = storage.state_tensors(fresh.model_parts, fresh_opt)
    on_cpu = full_tensors(uri, STEPS)
    assert loaded.keys() == live.keys() == on_cpu.keys() and any(k.startswith("optim.") for k in live)
    for key, t in live.items():
        mine = t.full_tensor() if hasattr(t, "full_tensor") else t
        theirs = loaded[key].full_tensor() if hasattr(loaded[key], "full_tensor") else loaded[key]
        assert torch.equal(mine, theirs) and theirs.device == mine.device, key
        assert torch.equal(mine.cpu(), on_cpu[key]), key
    # Both continue identically from the loaded state.
    assert _train(fresh, fresh_opt, batches[:2], scale) == _train(pm, opt, batches[:2], scale)


def test_agent_gives_each_rank_process_its_own_gpu():
    import ray

    from elastic.agent import NodeAgent
    from elastic.cluster import EmbeddedCluster

    gpus = torch.cuda.device_count()
    cluster = EmbeddedCluster(1, 2 * gpus, gpus_per_node=gpus, workers_on_head=True)
    pids: list[int] = []
    try:
        agent = NodeAgent.options(num_cpus=gpus, num_gpus=gpus).remote(1.0, 1.0)
        pids = ray.get(agent.prepare.remote(gpus, 0, 120.0))
        seen = []
        for pid in pids:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            seen.append(env.get("CUDA_VISIBLE_DEVICES"))
        assert sorted(seen) == sorted(str(g) for g in ray.get(agent.info.remote())["gpu_ids"]), seen
        assert len(set(seen)) == gpus and all(s for s in seen)
    finally:
        cluster.shutdown()
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def _job(tmp_path, name, **over):
    """test_ray_elastic's job config, shrunk to one worker with one GPU."""
    from test_ray_elastic import _cfg

    one_gpu = {
        "training.steps": 24,
        "parallel.dp_shard": 1,
        "scaling.num_workers": 1,
        "scaling.min_workers": 1,
        "scaling.workers_per_node": 1,
        "scaling.gpus_per_worker": 1,
    }
    return _cfg(tmp_path, name, **one_gpu, **over)


def _killed_at_13_and_resumed(tmp_path, what: str, **over) -> dict:
    """A one-GPU job (with `over`) whose rank is killed at step 13, against the same job uninterrupted: the same
    samples, once each, and the same final state (bf16 mixed precision: within 1e-3, bit-exact is printed); its one failure."""
    from ckpt_utils import full_tensors
    from elastic.job import run_job

    ref = run_job(_job(tmp_path, "ref"), quiet=True)
    hit = run_job(_job(tmp_path, "kill", **over), ["kill:rank=0,step=13"], quiet=True)
    assert ref["state"] == hit["state"] == "FINISHED", (ref.get("reason"), hit.get("reason"))
    (failure,) = hit["failures"]
    assert failure["kind"] == "kill" and failure["rank"] == 0
    s = hit["samples"]
    assert s["missing"] == 0 and s["duplicated"] == 0
    assert hit["final_loss"] < hit["initial_loss"]
    a, b = full_tensors(str(tmp_path / "ref" / "ckpt"), 24), full_tensors(str(tmp_path / "kill" / "ckpt"), 24)
    assert a.keys() == b.keys()
    exact = all(torch.equal(a[k], b[k]) for k in a)
    print(f"GPU job resumed from {what} ({failure['lost_steps']} steps lost): final state bit-exact with the uninterrupted run: {exact}")
    worst = max(float((a[k].double() - b[k].double()).norm() / a[k].double().norm().clamp_min(1e-30)) for k in a)
    assert worst < 1e-3, worst
    return hit


def test_job_on_the_gpu_recovers_a_killed_rank_from_its_gpu_checkpoint(tmp_path):
    _killed_at_13_and_resumed(tmp_path, "its checkpoint", **{"checkpoint.async_save": "true"})


def test_job_on_the_gpu_recovers_a_killed_rank_from_its_memory_snapshot(tmp_path):
    # One GPU: one worker on one node, so no replica; each step's snapshot is the pinned side-stream copy
    # (elastic.train.Trainer._write_memory), and the killed rank's successor loads it back onto the GPU.
    memory = {"checkpoint.memory": "true", "checkpoint.memory_replicas": "0", "checkpoint.memory_dir": str(tmp_path / "node-memory")}
    hit = _killed_at_13_and_resumed(tmp_path, "its memory snapshot", **memory)
    (failure,) = hit["failures"]
    assert failure["restored_from"] == "memory" and failure["lost_steps"] <= 1, failure
    assert hit["memory_tier"]["snapshots_committed"] >= 20
