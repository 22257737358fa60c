"""The `tokens` and `builder` data sources without a cluster: packing, lazy reads, plug-ins, s3://, and the one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import storage
from elastic.config import ConfigError, load_config
from elastic.data import describe, open_datasets, resume_position
from elastic.tokens import CorpusIndex, TokenReader, TokenWindows
from token_corpus import EOS, VOCAB, windows, write_corpus

SEQ = 8


def _cfg(data: dict, **training):
    return load_config(data={
        "model": {"vocab_size": VOCAB, "max_seq_len": 32},
        "data": {"kind": "tokens", "seq_len": SEQ, "eos_token": EOS, **data},
        "training": {"global_batch": 8, "micro_batch": 4, **training},
    })


def _all(cfg):
    info = describe(cfg)
    train, held = open_datasets(cfg, info)
    return info, train, held


@pytest.mark.parametrize("kinds", [("parquet",), ("arrow",), ("arrow_stream",), ("bin",), ("bin32",), ("parquet", "arrow", "bin")])
def test_windows_follow_the_packing_rule(tmp_path, kinds):
    stream = write_corpus(tmp_path / "c", kinds)
    dtype = "uint32" if "bin32" in kinds else "uint16"
    info, train, held = _all(_cfg({"path": str(tmp_path / "c"), "dtype": dtype, "eval_samples": 8}))
    n = (len(stream) - 1) // SEQ
    assert info.train_samples == n - 8 and len(train) == n - 8 and len(held) == 8
    np.testing.assert_array_equal(train.windows(list(range(len(train)))), windows(stream, SEQ, range(n - 8)))
    np.testing.assert_array_equal(held.windows(list(range(8))), windows(stream, SEQ, range(n - 8, n)))  # the last windows
    order = [5, 0, len(train) - 1, 5]
    inputs, labels = train.batch(order)
    want = torch.from_numpy(windows(stream, SEQ, order))
    assert torch.equal(inputs, want[:, :-1]) and torch.equal(labels, want[:, 1:])


def test_no_eos_and_a_glob_of_one_format(tmp_path):
    write_corpus(tmp_path / "c", ("parquet", "arrow", "parquet"))
    info, train, _ = _all(_cfg({"path": str(tmp_path / "c" / "*.parquet"), "eos_token": None, "num_samples": 10}))
    stream = []
    for name in ("00.parquet", "02.parquet"):
        stream += [t for doc in pq.read_table(tmp_path / "c" / name).column("input_ids").to_pylist() for t in (doc or [])]
    assert len(train) == 10 and info.identity["samples"] == 10  # num_samples caps the corpus's windows
    np.testing.assert_array_equal(train.windows(list(range(10))), windows(stream, SEQ, range(10)))


def test_eval_path_is_a_corpus_of_its_own(tmp_path):
    stream = write_corpus(tmp_path / "c", ("bin",))
    held_stream = write_corpus(tmp_path / "held", ("parquet",), seed=5)
    info, train, held = _all(_cfg({"path": str(tmp_path / "c"), "eval_path": str(tmp_path / "held")}))
    n, m = (len(stream) - 1) // SEQ, (len(held_stream) - 1) // SEQ
    assert (len(train), len(held), info.eval_samples) == (n, m, m)  # nothing carved off the training corpus
    np.testing.assert_array_equal(held.windows(list(range(m))), windows(held_stream, SEQ, range(m)))
    _, _, capped = _all(_cfg({"path": str(tmp_path / "c"), "eval_path": str(tmp_path / "held"), "eval_samples": 16}))
    assert len(capped) == 16
    with pytest.raises(ConfigError, match="data.eval_path"):
        describe(_cfg({"path": str(tmp_path / "c"), "eval_path": str(tmp_path / "held"), "eval_samples": m + 8}))


def _touched() -> int:
    """Bytes this process has read through system calls plus file pages it has mapped in: what a read cost it."""
    io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return int(io["rchar"]) + int(status["RssFile"].split()[0]) * 1024


def test_one_window_reads_a_sliver_of_the_files(tmp_path):
    """A window costs its own pages (.bin) or its one row group (Parquet), never the file.

    The kernel may map a file's pages in large folios (2 MiB here), so the
    files are 64 MiB and a window may cost a sixteenth of that.
    """
    corpus = tmp_path / "c"
    corpus.mkdir()
    tokens = 32 << 20
    np.random.default_rng(0).integers(0, VOCAB, tokens, dtype=np.uint16).tofile(corpus / "a.bin")
    values = pa.array(np.random.default_rng(1).integers(0, VOCAB, tokens // 2, dtype=np.int32))
    docs = pa.ListArray.from_arrays(pa.array(np.arange(0, tokens // 2 + 1, 512, dtype=np.int32)), values)
    pq.write_table(pa.table({"input_ids": docs}), corpus / "b.parquet", row_group_size=512, compression="none")  # 64 groups of 1 MiB
    sizes = {p.name: p.stat().st_size for p in corpus.iterdir()}
    cfg = _cfg({"path": str(corpus), "eos_token": None}, global_batch=8)
    info = describe(cfg)
    for name, window in (("a.bin", 1_000_003), ("b.parquet", tokens // SEQ + 999_999)):
        train, _ = open_datasets(cfg, info)
        before = _touched()
        train.windows([window])
        cost = _touched() - before
        assert cost <= sizes[name] / 16, (name, cost, sizes[name])
    assert train.reader.bytes_fetched < sizes["b.parquet"] / 32  # one row group's column chunk


def test_corpus_changed_after_indexing_is_an_error(tmp_path):
    write_corpus(tmp_path / "c", ("parquet", "bin"))
    cfg = _cfg({"path": str(tmp_path / "c")})
    info = describe(cfg)
    with open(tmp_path / "c" / "01.bin", "ab") as f:
        f.write(b"\0\0")
    train, _ = open_datasets(cfg, info)
    with pytest.raises(ValueError, match="changed"):
        train.windows([len(train) - 1])


@pytest.mark.parametrize(
    "data, training, field",
    [
        ({"path": "{tmp}/nothing-here"}, {}, "no such file"),
        ({"path": "{tmp}/c/*.arrow"}, {}, "matched no"),
        ({"path": "{tmp}/c", "column": "tokens"}, {}, "data.column 'tokens': not in"),
        ({"path": "{tmp}/c", "column": "text"}, {}, "data.column 'text' of"),
        ({"path": "{tmp}/odd"}, {}, "data.dtype uint16"),
        ({"path": "{tmp}/c", "dtype": "uint32"}, {}, "not below the model's vocabulary (64); check data.dtype"),  # uint16 read as uint32
        ({"path": "{tmp}/c/00.parquet"}, {"global_batch": 512, "micro_batch": 4}, "fewer than one training.global_batch (512)"),
        ({"path": "{tmp}/c", "num_samples": 10_000}, {}, "data.num_samples (10000)"),
        ({"path": "{tmp}/c", "eos_token": 99}, {}, "data.eos_token (99) is not below the model's vocabulary (64)"),
        ({"kind": "synthetic", "path": "{tmp}/c"}, {}, "data.path is set but data.kind is synthetic"),
        ({"path": ""}, {}, "data.path is required"),
    ],
)
def test_bad_data_is_one_line_naming_the_field(tmp_path, data, training, field):
    write_corpus(tmp_path / "c", ("parquet", "bin"))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "x.bin").write_bytes(b"\0\0\0")
    data = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in data.items()}
    with pytest.raises(ConfigError) as err:
        describe(_cfg(data, **training))
    assert field in str(err.value) and "\n" not in str(err.value)


def test_cli_refuses_a_missing_corpus_before_starting(tmp_path, capsys):
    from elastic.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(f"data: {{kind: tokens, path: {tmp_path}/missing}}\nrun_root: {tmp_path}/runs\n")
    assert main(["run", str(job)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.path" in err[0] and "no such file" in err[0]


BUILDER = """
import torch

class Squares:
    def __init__(self, n, seq_len):
        self.n, self.seq_len = n, seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        row = (torch.arange(self.seq_len + 1) * i) % 50
        return row[:-1], row[1:]

def squares(n, seq_len=8):
    return Squares(n, seq_len)

def broken(n):
    return [(torch.zeros(3), torch.zeros(3))] * n
"""


def test_builder_plugin_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_data.py").write_text(textwrap.dedent(BUILDER))
    monkeypatch.chdir(tmp_path)  # the job's working directory: a module there resolves
    cfg = load_config(data={"data": {"kind": "builder", "builder": "my_data:squares", "args": {"n": 40}, "seq_len": SEQ, "eval_samples": 8},
                            "training": {"global_batch": 8, "micro_batch": 4}})
    info = describe(cfg)
    train, held = open_datasets(cfg, info)
    assert (len(train), len(held), info.identity["builder"], info.identity["args"]) == (32, 8, "my_data:squares", {"n": 40})
    inputs, labels = held.batch([0, 7])
    assert torch.equal(inputs[1], (torch.arange(SEQ) * 39) % 50) and torch.equal(labels[0], (torch.arange(1, SEQ + 1) * 32) % 50)
    for builder, args, message in (("my_data:broken", {"n": 40}, "inputs: expected integer token ids of shape (8,)"),
                                   ("my_data:nothing", {}, "has no function 'nothing'"),
                                   ("not_there:fn", {}, "cannot import 'not_there'"),
                                   ("my_data:squares", {"m": 1}, "TypeError")):
        bad = cfg.model_copy(deep=True)
        bad.data.builder, bad.data.args = builder, args
        with pytest.raises(ConfigError, match="data.builder") as err:
            describe(bad)
        assert message in str(err.value)


def test_s3_corpus_reads_by_range(s3, tmp_path):
    import s3fs

    stream = write_corpus(tmp_path / "c", ("parquet", "arrow", "bin"))
    s3fs.S3FileSystem(skip_instance_cache=True).put(str(tmp_path / "c"), f"{s3}/corpus", recursive=True)
    info, train, _ = _all(_cfg({"path": f"{s3}/corpus"}))
    assert info.identity["files"] == CorpusIndex.from_json(describe(_cfg({"path": str(tmp_path / "c")})).index).fingerprint()
    got = train.windows(list(range(len(train)))[::-1])  # backwards: each chunk is read when a window asks for it
    np.testing.assert_array_equal(got[::-1], windows(stream, SEQ, range(len(train))))
    assert train.reader.read_ahead_used == 0
    forward = TokenWindows(TokenReader(CorpusIndex.from_json(info.index), train.reader.cfg), SEQ, 0, len(train))
    batches = [list(range(i, min(i + 4, len(train)))) for i in range(0, len(train), 4)]  # in order: chunks are read ahead
    np.testing.assert_array_equal(np.concatenate([forward.windows(b) for b in batches]), windows(stream, SEQ, range(len(train))))
    assert forward.reader.read_ahead_used >= 10  # of the Parquet file's 9 row groups and the Arrow file's 6 batches
    reader = TokenReader(CorpusIndex.from_json(info.index), train.reader.cfg)
    size = os.path.getsize(tmp_path / "c" / "02.bin")
    reader.read([(len(stream) - 2 * SEQ, len(stream) - SEQ)])  # inside the .bin file
    assert 0 < reader.bytes_fetched <= SEQ * 2 < size


def test_resume_position_refuses_other_data(tmp_path):
    write_corpus(tmp_path / "c", ("parquet", "bin"))
    cfg = _cfg({"path": str(tmp_path / "c")})
    info = describe(cfg)
    uri = str(tmp_path / "ckpt")
    rows = storage.write_shards(uri, 4, 0, {"model.w": torch.zeros(2)}, generation=1)
    storage.commit(uri, 4, rows, generation=1, layout={}, train_state={"step": 4, "data": {"position": 32, "identity": info.identity}})
    assert resume_position(uri, 4, info) == 32
    shutil.copytree(tmp_path / "c", tmp_path / "moved")  # the same files elsewhere: another path all the same
    synthetic = load_config(data={"model": {"vocab_size": VOCAB}, "data": {"seq_len": SEQ}, "training": {"global_batch": 8, "micro_batch": 4}})
    for data, *fields in (({"seed": 5}, "data.seed changed (1234 -> 5)"), ({"seq_len": 4}, "data.seq_len changed (8 -> 4)"),
                          ({"eos_token": None}, "data.eos_token changed (61 -> None)"),
                          ({"path": str(tmp_path / "moved")}, "data.path changed", "/c' -> '", "/moved')"),  # shortened, the ends kept
                          ({"kind": "synthetic"}, "data.kind changed ('tokens' -> 'synthetic')"), ({"new_file": True}, "data.path's files")):
        if data.pop("new_file", False):
            (tmp_path / "c" / "02.bin").write_bytes(np.zeros(50, np.uint16).tobytes())
        cfg = synthetic if data.get("kind") == "synthetic" else _cfg({"path": str(tmp_path / "c"), **data})
        with pytest.raises(ConfigError) as err:
            resume_position(uri, 4, describe(cfg))
        assert all(f in str(err.value) for f in fields) and "step 4" in str(err.value) and "\n" not in str(err.value)
    storage.commit(uri, 8, storage.write_shards(uri, 8, 0, {"model.w": torch.zeros(2)}, generation=1), generation=1, layout={}, train_state={"step": 8})
    with pytest.raises(ConfigError, match="no data position"):
        resume_position(uri, 8, info)
    assert json.loads(json.dumps(info.to_json())) == info.to_json()  # ranks receive it as JSON
