"""A model defined outside the project, trained through `elastic run` from its own directory, through faults.

The model lives in a temporary directory (not importable from `elastic` or
the repository) next to its job YAML, and `elastic run` starts there, as
`ray job submit --working-dir .` would: the builder must be found by the
driver and by every rank process. It exercises the library-run stage
(`run_parts`) with a per-forward block input, an `nn.ModuleList` of blocks,
a non-persistent buffer re-created after materialising, and a TP plan with
sequence parallelism whose gather takes a keyword input.

- dp_shard=2 x tp=2, uninterrupted: the reference;
- the same, a rank killed (replaced at the same layout: losses bit-exact),
  then a node lost (4 -> 2 workers, resumed at tp=2 from the last
  checkpoint): every sample exactly once, losses within 1e-5;
- pp=2 x dp_shard=2, uninterrupted: losses within 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS, GLOBAL_BATCH = 12, 8

MODEL = '''
"""A tiny causal language model that is not the built-in transformer: residual blocks of a causal prefix-mean mixer."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from strategies import ModelSpec, SequenceGather


class Mixer(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x, positions):
        x = x + positions
        x = torch.cumsum(x, 1) / torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mixer = Mixer(dim, hidden)

    def forward(self, h, positions):
        return h + self.mixer(self.norm(h), positions=positions)


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, hidden, n_blocks):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("freqs", frequencies(dim), persistent=False)


def frequencies(dim):
    return 1.0 / (100.0 ** (torch.arange(dim, dtype=torch.float32) / dim))


def positions(model, hidden, seq_len):
    return torch.sin(torch.arange(seq_len, device=hidden.device, dtype=torch.float32)[:, None] * model.freqs)[None]


def tp_plan(*, sequence_parallel):
    act = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "blocks.*.mixer.up": ColwiseParallel(),
        "blocks.*.mixer.down": RowwiseParallel(output_layouts=act),
        "head": ColwiseParallel(input_layouts=act, output_layouts=Replicate(), use_local_output=True),
    }
    if sequence_parallel:
        plan.update({"norm": SequenceParallel(use_local_output=False), "blocks.*.norm": SequenceParallel(),
                     "blocks.*.mixer": SequenceGather("x")})
    return plan


def init_buffers(stage):
    stage.freqs.copy_(frequencies(stage.freqs.numel()))


def build(vocab, dim, hidden, n_blocks):
    model = TinyLM(vocab, dim, hidden, n_blocks)
    spec = ModelSpec(blocks="blocks", first=("embed",), last=("norm", "head"), tp_plan=tp_plan, run_parts=True,
                     block_inputs=lambda stage, hidden, seq_len: {"positions": positions(stage, hidden, seq_len)},
                     init_buffers=init_buffers, vocab_size=vocab)
    return model, spec
'''

JOB = '''
name: mine
run_root: runs
model: {builder: "tiny_lm:build", args: {vocab: 32, dim: 16, hidden: 32, n_blocks: 4}}
data: {seq_len: 8, seed: 3}
parallel: {tp: 2}
scaling: {num_workers: 4, min_workers: 2, workers_per_node: 2}
training: {global_batch: 8, micro_batch: 2, steps: 12, lr: 0.01, warmup_steps: 2}
checkpoint: {every_steps: 4, keep: 3}
'''


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("user_job")
    (d / "tiny_lm.py").write_text(textwrap.dedent(MODEL))
    (d / "job.yaml").write_text(textwrap.dedent(JOB))
    return d


def elastic_run(job_dir: Path, name: str, *args: str) -> dict:
    """`elastic run job.yaml` (the console script: its own directory, not the job's, heads the import path) in the job's directory."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    cmd = [str(Path(sys.executable).with_name("elastic")), "run", "job.yaml", "--quiet", "--set", f"name={name}", *args]
    out = subprocess.run(cmd, cwd=job_dir, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads((job_dir / "runs" / name / "report.json").read_text())


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _clean_ledger(report: dict) -> None:
    s = report["samples"]
    assert s["missing"] == 0 and s["duplicated"] == 0
    assert s["seen_once"] == s["expected"] == STEPS * GLOBAL_BATCH


@pytest.fixture(scope="module")
def reference(job_dir) -> dict:
    report = elastic_run(job_dir, "ref")
    assert report["state"] == "FINISHED" and report["world_sizes"] == [4]
    assert len(report["losses"]) == STEPS and report["final_loss"] < report["initial_loss"]
    return report


def test_the_model_is_not_importable_from_the_project(job_dir):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", "import tiny_lm"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "No module named 'tiny_lm'" in out.stderr


def test_killed_then_shrunk_keeps_every_sample_and_the_losses(job_dir, reference):
    hit = elastic_run(job_dir, "hit", "--inject", "kill:rank=1,step=3", "--inject", "node:rank=3,step=9")
    assert hit["state"] == "FINISHED"
    assert hit["world_sizes"] == [4, 4, 2]
    assert [f["kind"] for f in hit["failures"]] == ["kill", "node"]
    _clean_ledger(hit)
    resumed_at = 8  # the node fault at step 9 resumes from the checkpoint after step 8, at tp=2 on 2 workers
    assert hit["losses"][:resumed_at] == reference["losses"][:resumed_at]  # same layout: bit-exact
    assert _rel(hit["losses"], reference["losses"]) < 1e-5


def test_pipeline_layout_trains_the_same(job_dir, reference):
    pp = elastic_run(job_dir, "pp", "--set", "parallel.tp=1", "--set", "parallel.pp=2")
    assert pp["state"] == "FINISHED" and pp["world_sizes"] == [4]
    _clean_ledger(pp)
    assert _rel(pp["losses"], reference["losses"]) < 1e-5
