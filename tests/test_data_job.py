"""Jobs on tokenized corpora through an embedded Ray cluster: a resize mid-run, resume with another global batch, resume refused.

Every step event carries the digest of the tokens its ranks trained on; the
tests recompute it from the corpus files with the documented packing rule and
sample order (tests/token_corpus.py), so "step k read exactly the expected
rows" is checked from outside the job, for every step, including the ones a
recovery ran twice.
"""

from __future__ import annotations

import json

import yaml

from elastic.cli import main
from elastic.events import read_events
from elastic.job import run_job
from test_ray_elastic import _cfg
from token_corpus import EOS, digest, order, windows, write_corpus

SEQ = 16


def _tokens_cfg(tmp_path, name, path, **over):
    return _cfg(tmp_path, name, **{"data.kind": "tokens", "data.path": path, "data.eos_token": EOS, "data.seq_len": SEQ, **over})


def _check_every_step(report, events, stream, seed, n, global_batch, start_position=0, first_step=0):
    """The ledger is exact, and each step (every run of it) trained on the windows at its positions of the order."""
    s = report["samples"]
    assert s["missing"] == 0 and s["duplicated"] == 0 and s["seen_once"] == s["expected"] == report["steps_completed"] * global_batch
    steps = [e for e in events if e["event"] == "step"]
    # Step events count completed steps: the step after `first_step` completed ones is step first_step + 1.
    assert {e["step"] for e in steps} == set(range(first_step + 1, first_step + report["steps_completed"] + 1))
    for e in steps:
        position = start_position + (e["step"] - 1 - first_step) * global_batch
        assert e["data_position"] == position
        indices = order(seed, n, range(position, position + global_batch))
        assert e["data_digest"] == digest(windows(stream, SEQ, indices)), e["step"]


def _run_with_resize(tmp_path, name, path, stream):
    cfg = _tokens_cfg(tmp_path, name, path, **{"training.eval_every": 8, "data.eval_samples": 16})
    report = run_job(cfg, ["node:rank=3,step=13"], quiet=True)
    assert report["state"] == "FINISHED" and report["world_sizes"] == [4, 2]
    n = (len(stream) - 1) // SEQ - 16  # the last 16 windows are the eval split
    assert report["data"]["train_samples"] == n and report["data"]["end_position"] == 32 * 16
    events = read_events(cfg.run_dir / "events.jsonl")
    _check_every_step(report, events, stream, cfg.data.seed, n, 16)
    assert [e["step"] for e in report["eval_losses"]] == [8, 16, 24, 32]


def test_local_corpus_resized_mid_run_reads_exactly_the_expected_rows(tmp_path):
    stream = write_corpus(tmp_path / "corpus", ("parquet", "arrow", "bin"))
    _run_with_resize(tmp_path, "local", str(tmp_path / "corpus"), stream)


def test_s3_corpus_resized_mid_run_reads_exactly_the_expected_rows(tmp_path, s3):
    import s3fs

    stream = write_corpus(tmp_path / "corpus", ("parquet", "arrow", "bin"))
    s3fs.S3FileSystem(skip_instance_cache=True).put(str(tmp_path / "corpus"), f"{s3}/corpus", recursive=True)
    _run_with_resize(tmp_path, "s3", f"{s3}/corpus", stream)


def test_resume_with_another_global_batch_continues_and_other_data_is_refused(tmp_path, capsys):
    stream = write_corpus(tmp_path / "corpus", ("bin", "parquet"))
    n = (len(stream) - 1) // SEQ
    small = {"scaling.num_workers": 2, "scaling.workers_per_node": 0, "checkpoint.every_steps": 4}
    first = _tokens_cfg(tmp_path, "gb", str(tmp_path / "corpus"), **small, **{"training.steps": 12})
    a = run_job(first, quiet=True)
    assert a["state"] == "FINISHED" and a["data"]["end_position"] == 12 * 16
    events_a = read_events(first.run_dir / "events.jsonl")
    _check_every_step(a, events_a, stream, first.data.seed, n, 16)

    second = _tokens_cfg(tmp_path, "gb", str(tmp_path / "corpus"), **small,
                         **{"training.steps": 20, "training.global_batch": 32, "training.micro_batch": 8})
    b = run_job(second, quiet=True)
    assert b["state"] == "FINISHED" and b["data"]["start_position"] == a["data"]["end_position"]
    events_b = read_events(second.run_dir / "events.jsonl")  # this invocation's log; the first one's is in attempts/1
    assert read_events(second.run_dir / "attempts" / "1" / "events.jsonl") == events_a
    assert [e["resume_step"] for e in events_b if e["event"] == "generation_start"] == [12]
    _check_every_step(b, events_b, stream, first.data.seed, n, 32, start_position=12 * 16, first_step=12)
    # Together: positions [0, 192) then [192, 448) of the order, every step's rows as expected: each sample exactly once per epoch.

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(json.loads(second.model_dump_json())))
    # training.steps raised: a finished run is refused as such before its data is compared.
    for sets, field in ((["data.seed=99", "training.steps=24"], "data.seed changed (1234 -> 99)"),
                        (["data.seq_len=8", "training.steps=24"], "data.seq_len changed (16 -> 8)")):
        assert main(["run", str(job), *(a for s in sets for a in ("--set", s))]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and field in err[0] and "cannot resume from step 20" in err[0]
    write_corpus(tmp_path / "corpus" / "more", ("bin",), seed=7)  # one more file under data.path
    assert main(["run", str(job), "--set", "training.steps=24"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.path's files" in err[0]
