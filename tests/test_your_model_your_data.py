"""The README's path for a new user, end to end, the way they would type it: text -> `elastic data prepare` ->
a job YAML that names a Hugging Face Llama builder and the token files -> `elastic run` (a worker killed on the
way, the job resumed) -> `elastic ckpt export` -> `AutoModelForCausalLM.from_pretrained`.

Every step is the console script in a subprocess with a plain environment; only the last one is Python, as the
user's own code after training would be. Skipped without the `hf` extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
