"""The README's path for a new user, end to end, the way they would type it: text -> `elastic data prepare` ->
a job YAML that names a Hugging Face Llama builder and the token files -> `elastic run` (a worker killed on the
way, the job resumed) -> `elastic ckpt export` -> `AutoModelForCausalLM.from_pretrained`.

Every step is the console script in a subprocess with a plain environment; only the last one is Python, as the
user's own code after training would be. Then the fine-tuning flow: `python -m elastic run` starts a Llama from
a `save_pretrained` directory (`model.args.config` and `model.init_from`), loses a node and resumes at another
layout, and trains like `LlamaForCausalLM.from_pretrained` in one process. Skipped without the `hf` extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from token_corpus import order, windows, write_corpus

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _elastic(*args: str, cwd: Path, home: Path) -> subprocess.CompletedProcess:
    env = {"PATH": f"{BIN}{os.pathsep}/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    return subprocess.run([str(BIN / "elastic"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_text_to_a_trained_hugging_face_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from ckpt_utils import full_tensors

    raw = tmp_path / "raw"
    raw.mkdir()
    lines = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13} times." for i in range(120)]
    (raw / "corpus.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    out = _elastic("data", "prepare", str(raw), "--out", str(tmp_path / "tokens"), cwd=REPO, home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "kind: tokens" in out.stdout  # it ends with the data section to paste

    job = {
        "name": "mine", "run_root": str(tmp_path / "runs"),
        "model": {"builder": "examples.hf_llama:build",
                  "args": {"vocab_size": 258, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                           "tie_word_embeddings": False}},
        "data": {"kind": "tokens", "path": str(tmp_path / "tokens"), "dtype": "uint16", "seq_len": 16},
        "parallel": {"tp": 2},
        "scaling": {"num_workers": 2, "min_workers": 2},
        "training": {"steps": 12, "global_batch": 8, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 2},
        "checkpoint": {"every_steps": 4},
        "fault": {"inject": ["kill:rank=1,step=6"]},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out = _elastic("run", str(tmp_path / "job.yaml"), "--quiet", cwd=REPO, home=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "runs" / "mine" / "report.json").read_text())
    assert report["state"] == "FINISHED" and report["steps_completed"] == 12
    (failure,) = report["failures"]
    assert failure["kind"] == "kill" and failure["resume_step"] == 4
    assert report["samples"]["missing"] == 0 and report["samples"]["duplicated"] == 0

    out = _elastic("ckpt", "export", str(tmp_path / "runs" / "mine"), str(tmp_path / "hf"), cwd=REPO, home=tmp_path)
    assert out.returncode == 0, out.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained = full_tensors(str(tmp_path / "runs" / "mine" / "checkpoints"), 12)
    for name, param in model.state_dict().items():
        assert torch.equal(param, trained[f"model.{name}"]), name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 258) and torch.isfinite(logits).all()


FINE_TUNE = {
    "name": "tuned",
    "data": {"kind": "tokens", "path": "tokens", "dtype": "uint16", "seq_len": 16, "seed": 3},
    "parallel": {"tp": 2},
    "scaling": {"num_workers": 4, "min_workers": 2, "workers_per_node": 2},
    "training": {"steps": 8, "global_batch": 8, "micro_batch": 2, "lr": 1e-2, "warmup_steps": 2},
    "checkpoint": {"every_steps": 4},
    "fault": {"inject": ["node:rank=3,step=6"]},  # its node's 2 workers go: 4 workers (dp_shard=2 x tp=2) -> 2 (tp=2)
}
"""A fine-tuning job on 2 simulated nodes; `model` (the released directory) and the paths are filled in by the test."""


def _reference_losses(released: Path, stream: list[int], job: dict) -> list[float]:
    """The job's steps in one process: `from_pretrained`, AdamW, the job's schedule and clipping, each step's global batch."""
    import torch
    from transformers import LlamaForCausalLM

    from elastic.config import load_config
    from elastic.schedule import lr_at
    from strategies import token_loss_sum

    cfg = load_config(data=job)
    t, seq = cfg.training, cfg.data.seq_len
    model = LlamaForCausalLM.from_pretrained(released, attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay, foreach=True)
    n = (len(stream) - 1) // seq
    losses = []
    for step in range(t.steps):
        rows = torch.from_numpy(windows(stream, seq, order(cfg.data.seed, n, range(step * t.global_batch, (step + 1) * t.global_batch))))
        loss = token_loss_sum(model(input_ids=rows[:, :-1], use_cache=False).logits, rows[:, 1:]) / (t.global_batch * seq)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_fine_tune_from_pretrained_loses_a_node_and_resumes_at_another_layout(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from elastic.events import read_events

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.2)
    # Hugging Face's own initialisation, wide enough that the first loss is far from ln(vocab): a released model, not a fresh one
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "released")
    stream = write_corpus(tmp_path / "tokens", ("bin",))
    released = str(tmp_path / "released")
    job = {**FINE_TUNE, "run_root": str(tmp_path / "runs"), "model": {"builder": "examples.hf_llama:build", "args": {"config": released},
                                                                     "init_from": released}}
    job["data"] = {**job["data"], "path": str(tmp_path / "tokens")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    out = subprocess.run([sys.executable, "-m", "elastic", "run", str(tmp_path / "job.yaml"), "--quiet"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]

    run_dir = tmp_path / "runs" / "tuned"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["state"] == "FINISHED" and report["world_sizes"] == [4, 2]
    assert [(g["dp_shard"], g["tp"]) for g in report["layouts"]] == [(2, 2), (1, 2)]
    (failure,) = report["failures"]
    assert failure["kind"] == "node" and failure["resume_step"] == 4
    s = report["samples"]
    assert s["missing"] == 0 and s["duplicated"] == 0 and s["seen_once"] == s["expected"] == 8 * 8
    want = _reference_losses(tmp_path / "released", stream, job)
    assert want[0] - min(want) > 0.1  # it trains: the losses move far more than the tolerance
    (first,) = [e["loss"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "step" and e["step"] == 1]
    assert abs(first - want[0]) <= 1e-5 * want[0], (first, want[0])  # the released weights, not a seeded initialisation
    assert max(abs(a - b) / b for a, b in zip(report["losses"], want)) < 1e-5, (report["losses"], want)
