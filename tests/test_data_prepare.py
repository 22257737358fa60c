"""`elastic data prepare`: text and JSONL -> .bin and Parquet shards that a `tokens` job reads as the same stream (the CLI in a subprocess), and its one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from elastic.config import load_config
from elastic.data import describe, open_datasets
from token_corpus import windows

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["The quick brown fox jumps over the lazy dog.", "Élan vital ✓", "", "a\nsecond line\n", "short"] * 6


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "elastic", "data", "prepare", *args], capture_output=True, text=True, env=env, timeout=120)


def _inputs(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    (raw / "sub").mkdir(parents=True)
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS[:20])]
    (raw / "a.jsonl").write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")  # a blank line is skipped
    (raw / "sub" / "b.txt").write_text("".join(DOCS[20:]))  # one document
    (raw / "notes.csv").write_text("ignored")
    return raw


def _stream(cfg_data: dict) -> list[int]:
    cfg = load_config(data={"model": {"vocab_size": 300, "max_seq_len": 16}, "data": {"seq_len": 8, **cfg_data},
                            "training": {"global_batch": 4, "micro_batch": 2}})
    info = describe(cfg)
    train, _ = open_datasets(cfg, info)
    rows = train.windows(list(range(len(train))))
    return rows[:, :-1].ravel().tolist() + rows[-1, -1:].tolist()


def _summary_data(out: str) -> dict:
    line = next(ln for ln in out.splitlines() if ln.startswith("data: {"))
    return dict(item.split(": ") for item in line[len("data: {") : -1].split(", "))


def test_byte_level_bin_and_parquet_read_the_same_stream(tmp_path):
    raw = _inputs(tmp_path)
    docs = DOCS[:20] + ["".join(DOCS[20:])]
    want = [t for d in docs for t in list(d.encode("utf-8")) + [256]]
    streams = {}
    for fmt in ("bin", "parquet"):
        out = tmp_path / f"out-{fmt}"
        done = _cli(str(raw), "--out", str(out), "--format", fmt, "--shard-tokens", "200", "--row-group-tokens", "64")
        assert done.returncode == 0, done.stderr
        assert f"21 documents, {len(want)} tokens" in done.stdout and "vocab_size must be at least 257" in done.stdout
        data = _summary_data(done.stdout)
        assert data["path"] == str(out) and len(list(out.iterdir())) > 1  # several shards
        data = {k: (int(v) if k == "eos_token" else v) for k, v in data.items()}
        streams[fmt] = _stream(data)
    usable = (len(want) - 1) // 8 * 8 + 1
    assert streams["bin"] == streams["parquet"] == want[:usable]


def test_text_on_s3_in_and_shards_on_s3_out(tmp_path, s3):
    """Inputs and output on object storage: the same stream as from local files."""
    import s3fs

    raw = _inputs(tmp_path)
    s3fs.S3FileSystem(skip_instance_cache=True).put(str(raw), f"{s3}/raw", recursive=True)
    done = _cli(f"{s3}/raw", "--out", f"{s3}/tokens", "--shard-tokens", "200")
    assert done.returncode == 0, done.stderr
    data = _summary_data(done.stdout)
    assert data["path"] == f"{s3}/tokens" and len(s3fs.S3FileSystem(skip_instance_cache=True).ls(f"{s3}/tokens")) > 1
    docs = DOCS[:20] + ["".join(DOCS[20:])]
    want = [t for d in docs for t in list(d.encode("utf-8")) + [256]]
    assert _stream(data) == want[: (len(want) - 1) // 8 * 8 + 1]


def test_tokenizer_file_and_its_eos(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    raw = _inputs(tmp_path)
    out = tmp_path / "out"
    done = _cli(str(raw / "a.jsonl"), str(raw / "sub"), "--out", str(out), "--tokenizer", str(tmp_path / "tokenizer.json"),
                "--eos", "<|endoftext|>", "--format", "parquet")
    assert done.returncode == 0, done.stderr
    eos = tok.token_to_id("<|endoftext|>")
    data = _summary_data(done.stdout)
    assert int(data["eos_token"]) == eos
    docs = DOCS[:20] + ["".join(DOCS[20:])]
    want = [t for d in docs for t in tok.encode(d, add_special_tokens=False).ids + [eos]]
    got = _stream({"kind": "tokens", "path": str(out), "eos_token": eos})
    assert got == want[: len(got)] and len(want) - len(got) < 8
    np.testing.assert_array_equal(windows(want, 8, [0]), [got[:9]])


@pytest.mark.parametrize(
    "args, message",
    [
        (["{raw}/nothing"], "input '{raw}/nothing': no such file"),
        (["{raw}/notes.csv"], "not a .jsonl or .txt or .md file"),
        (["{raw}", "--eos", "x"], "--eos names a token of --tokenizer"),
        (["{raw}", "--tokenizer", "{raw}/missing.json"], "--tokenizer {raw}/missing.json: no such file"),
        (["{raw}", "--text-field", "body"], "no string field 'body'"),
        (["{raw}", "--out", "{raw}"], "not empty"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message, capsys):
    from elastic.cli import main

    raw = _inputs(tmp_path)
    args = [a.format(raw=raw) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    assert main(["data", "prepare", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message.format(raw=raw) in lines[0], lines
    assert not (tmp_path / "out").exists()  # nothing half-written is left behind
