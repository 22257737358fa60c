"""One job per run directory and checkpoint URI, one invocation per event log and report, no mixing of two runs' checkpoints.

The CLI is called the way a user calls it (`elastic.cli.main`, exit code 2 and
one line for every refusal); nothing here starts Ray: every refusal happens
before a worker would start.
"""

from __future__ import annotations

import json

import pytest
import torch

import storage
from elastic import rundir
from elastic.cli import main
from elastic.config import ConfigError, load_config

DEMO = "deploy/examples/demo.yaml"


def _cfg(tmp_path, *sets):
    cfg = load_config(DEMO, [f"run_root={tmp_path / 'runs'}", "name=job", "fault.inject=[]", *sets])
    cfg = cfg.model_copy(deep=True)
    cfg.checkpoint.uri = str((tmp_path / "runs" / "job" / "checkpoints").resolve()) if not cfg.checkpoint.uri else cfg.checkpoint.uri
    return cfg


def _commit(uri: str, step: int) -> None:
    rows = storage.write_shards(uri, step, 0, {"model.w": torch.full((4,), float(step))}, generation=1)
    storage.commit(uri, step, rows, generation=1, layout={"dp_shard": 1}, train_state={"step": step})


def _run_cli(tmp_path, capsys, *sets) -> tuple[int, str]:
    args = ["run", DEMO, "--quiet", "--set", f"run_root={tmp_path / 'runs'}", "--set", "name=job", "--set", "fault.inject=[]"]
    for item in sets:
        args += ["--set", item]
    code = main(args)
    err = capsys.readouterr().err.strip()
    return code, err


def test_a_second_job_on_the_same_run_is_refused(tmp_path, capsys):
    held = rundir.open_run(_cfg(tmp_path), fresh=False)
    try:
        code, err = _run_cli(tmp_path, capsys)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith("elastic: error: run directory:") and "held by job=job" in err and "another job is using it" in err
        # Another run directory, the same checkpoint URI: refused too, and --fresh deletes nothing of the first job's.
        _commit(held.leases[1].store.uri, 8)
        uri = held.leases[1].store.uri
        code = main(["run", DEMO, "--quiet", "--fresh", "--set", f"run_root={tmp_path / 'runs'}", "--set", "name=other",
                     "--set", f"checkpoint.uri={uri}"])
        err = capsys.readouterr().err
        assert code == 2 and "checkpoint.uri:" in err and "held by job=job" in err, err
        assert [c["step"] for c in storage.list_checkpoints(uri)] == [8]
    finally:
        held.release()
    assert not (held.run_dir / ".lease.json").exists()


def test_fresh_is_refused_while_another_job_holds_the_run(tmp_path, capsys):
    held = rundir.open_run(_cfg(tmp_path), fresh=False)
    (held.run_dir / "events.jsonl").write_text('{"t": 1, "event": "job_start"}\n')
    try:
        assert main(["run", DEMO, "--quiet", "--fresh", "--set", f"run_root={tmp_path / 'runs'}", "--set", "name=job"]) == 2
        assert "held by job=job" in capsys.readouterr().err
        assert (held.run_dir / "events.jsonl").exists()  # nothing deleted
    finally:
        held.release()


def test_resume_false_on_an_occupied_checkpoint_uri_is_refused(tmp_path, capsys):
    uri = tmp_path / "ckpt"
    _commit(str(uri), 40)
    code, err = _run_cli(tmp_path, capsys, f"checkpoint.uri={uri}", "checkpoint.resume=false")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "checkpoint.uri" in err and "--fresh" in err and "newest step 40" in err
    assert [c["step"] for c in storage.list_checkpoints(str(uri))] == [40]
    assert not rundir.attempts(tmp_path / "runs" / "job")


def test_a_finished_run_is_not_run_again_without_fresh(tmp_path, capsys):
    uri = tmp_path / "ckpt"
    _commit(str(uri), 20)
    code, err = _run_cli(tmp_path, capsys, f"checkpoint.uri={uri}", "training.steps=20")
    assert code == 2 and "final checkpoint of a finished run (step 20" in err and "--fresh" in err, err


def test_each_invocation_keeps_its_own_log_and_report(tmp_path):
    cfg = _cfg(tmp_path)
    first = rundir.open_run(cfg, fresh=False)
    assert first.attempt == 1
    (first.run_dir / "events.jsonl").write_text('{"t": 1, "event": "job_start"}\n')
    (first.run_dir / "report.json").write_text(json.dumps({"state": "FAILED"}))
    first.release()
    second = rundir.open_run(cfg, fresh=False)
    second.release()
    assert second.attempt == 2
    (old,) = rundir.attempts(second.run_dir)
    assert old.name == "1" and json.loads((old / "report.json").read_text()) == {"state": "FAILED"}
    assert not (second.run_dir / "events.jsonl").exists()
    third = rundir.open_run(cfg, fresh=True)  # --fresh starts the run over: no attempts left
    third.release()
    assert third.attempt == 1 and not rundir.attempts(third.run_dir)


def test_a_lost_lease_fails_the_job(tmp_path):
    from test_controller_steps import _setup

    from elastic.controller import State

    ctrl, _, _ = _setup(tmp_path)
    ctrl.step()
    ctrl.abort("lost the lease /x/.lease.json: taken over")
    assert ctrl.step() is State.FAILED and "lost the lease" in ctrl.failed_reason
    ctrl.checkpoints.close()


def test_open_run_refuses_a_foreign_directory_before_taking_a_lease(tmp_path):
    foreign = tmp_path / "runs" / "job"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not created by elastic"):
        rundir.open_run(_cfg(tmp_path), fresh=True)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("content", ["empty", "a user's files", "a step directory without a manifest", "a link to a checkpoint"])
def test_a_directory_holding_only_a_checkpoints_folder_is_not_taken_for_elastics(tmp_path, content):
    """An older version's run directory is recognised by its checkpoints (`step_*` with a manifest), not by the folder's name."""
    run_dir = tmp_path / "runs" / "job"
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True)
    if content == "a user's files":
        (ckpts / "model-final.pt").write_text("weeks of training")
    elif content == "a step directory without a manifest":
        (ckpts / "step_00000010").mkdir()
    elif content == "a link to a checkpoint":
        _commit(str(tmp_path / "elsewhere"), 10)
        (ckpts / "step_00000010").symlink_to(tmp_path / "elsewhere" / "step_00000010")
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    with pytest.raises(ConfigError, match="not empty and was not created by elastic"):
        rundir.claim(str(tmp_path / "runs"), "job", fresh=True)
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before


def test_an_older_versions_checkpoints_folder_is_recognised(tmp_path):
    run_dir = tmp_path / "runs" / "job"
    _commit(str(run_dir / "checkpoints"), 10)
    (run_dir / "checkpoints" / "step_00000020").mkdir()  # a save cut short
    assert rundir.claim(str(tmp_path / "runs"), "job", fresh=True) == run_dir
    assert sorted(p.name for p in run_dir.iterdir()) == [rundir.MARKER]
