"""Bad input is exit 2 and one line naming the field (or the fault spec), never a traceback; what is accepted runs.

The first tests run `python -m elastic` in a subprocess, as a user types it;
the parametrized ones go through `elastic.cli.main` in this process (the same
code path, without a second interpreter start for each case).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic import rundir
from elastic.cli import main
from elastic.config import ConfigError, load_config
from elastic.layout import Layout
from elastic.policies import ScalingPolicy
from elastic.preflight import check_job

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "deploy" / "examples" / "demo.yaml")


def _elastic(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    return subprocess.run([sys.executable, "-m", "elastic", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _one_line_error(result, *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# --------------------------------------------------------------------------- as the user types it
def test_cli_refuses_an_infinite_float_and_a_never_firing_fault(tmp_path):
    _one_line_error(_elastic("config", "validate", DEMO, "--set", "fault.heartbeat_s=.inf"), "fault.heartbeat_s", "finite")
    # `elastic run` refuses before it starts Ray: a rank that no layout of 4 workers has
    err = _one_line_error(_elastic("run", DEMO, "--set", f"run_root={tmp_path}", "--inject", "kill:rank=9,step=5"),
                          "--inject 'kill:rank=9,step=5'", "rank 9")
    assert "4 ranks" in err
    assert not (tmp_path / "demo").exists()


def test_cli_refuses_an_ignored_dp_shard_and_a_misspelt_fault_key(tmp_path):
    _one_line_error(_elastic("run", DEMO, "--set", f"run_root={tmp_path}", "--set", "parallel.dp_shard=3"), "parallel.dp_shard (3)")
    _one_line_error(_elastic("config", "validate", DEMO, "--inject", "random:cuont=2"), "'random:cuont=2'", "unknown key 'cuont'")


@pytest.mark.parametrize(("args", "printed"), [
    (("--help",), "COMMAND"),
    (("plan", "--params", "7e9", "--gpus", "64"), "7B parameters"),
    (("config", "validate", DEMO, "--set", "training.lr=-1"), None),
    (("run", DEMO, "--set", "parallel.dp_shard=3"), None),
    (("report", "no-such-run"), None),
], ids=["help", "plan-from-params", "field-error", "layout-error", "report"])
def test_help_and_refusals_answer_without_importing_torch_or_ray(args, printed, tmp_path):
    """The console script a user types, in a clean environment: help, a plan from a parameter count and a refused
    config answer at once (0.3-0.5 s, not the 3 s of importing torch and Ray that a job needs), with the same answer."""
    script = Path(sys.executable).with_name("elastic")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPROFILEIMPORTTIME": "1"}
    result = subprocess.run([str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert imported and not {m for m in imported if m.split(".")[0] in ("torch", "ray")}, sorted(imported)
    said = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    if printed:
        assert (result.returncode, said) == (0, []) and printed in result.stdout, result.stdout
    else:
        assert result.returncode == 2 and len(said) == 1 and said[0].startswith("elastic: error: "), result.stderr


@pytest.mark.parametrize("args", [("config", "schema"), ("config", "validate", DEMO)], ids=["written-while-running", "flushed-at-the-end"])
def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly(args):
    """`elastic config schema | head -1`: no BrokenPipeError, whichever command, and 141 as SIGPIPE ends a Unix filter.

    The reader is gone before the first write. A long output breaks while the
    command prints; a short one stays buffered until the entry point flushes it.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "elastic", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read()
    assert (proc.wait(timeout=120), err) == (141, b"")


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    import elastic.commands.config as config_command

    def schema(args):
        raise BrokenPipeError(32, "Broken pipe")  # a socket or a child's pipe: the command failed

    monkeypatch.setattr(config_command, "_schema", schema)
    assert main(["config", "schema"]) == 1
    assert capsys.readouterr().err == "elastic: error: BrokenPipeError: [Errno 32] Broken pipe\n"


def test_cli_fresh_leaves_a_foreign_directory_alone(tmp_path):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "notes.txt").write_text("mine")
    _one_line_error(_elastic("run", DEMO, "--fresh", "--set", f"run_root={tmp_path}"), "not created by elastic")
    assert (tmp_path / "demo" / "notes.txt").read_text() == "mine"


def test_cli_ckpt_list_of_a_missing_directory_is_an_error(tmp_path):
    _one_line_error(_elastic("ckpt", "list", str(tmp_path / "nope")), "no such directory")
    ok = _elastic("ckpt", "list", str(tmp_path))
    assert ok.returncode == 0 and "no committed checkpoints" in ok.stdout and ok.stderr == ""


def test_cli_plan_into_a_closed_pipe_is_quiet():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # 85 kB of JSON: more than a pipe holds, so the reader's going is seen while it prints
    proc = subprocess.Popen([sys.executable, "-m", "elastic", "plan", "--json", "--params", "7e9", "--gpus", "64", "--top", "1000"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"{"  # then stop reading, as `| head -1` does
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and stderr == "", stderr


# --------------------------------------------------------------------------- one line, naming the field
@pytest.mark.parametrize("sets, needles", [
    # not finite, or beyond a size that can work
    (["training.lr=.inf"], ["training.lr", "finite"]),
    (["training.lr=.nan"], ["training.lr", "finite"]),
    (["fault.hang_factor=.inf"], ["fault.hang_factor", "finite"]),
    (["scaling.cpus_per_worker=.nan"], ["scaling.cpus_per_worker", "finite"]),
    (["scaling.cpus_per_worker=1e-300"], ["scaling.cpus_per_worker", "0.01"]),
    (["data.num_samples=1000000000000"], ["data.num_samples", "134217728"]),
    (["data.num_samples=1e12"], ["data.num_samples", "134217728"]),  # YAML reads 1e12 as a string: taken as the number
    (["training.steps=1e9"], ["training.steps", "100000000"]),
    (["checkpoint.keep=5000"], ["checkpoint.keep", "1000"]),
    (["parallel.pp_microbatches=100000"], ["parallel.pp_microbatches", "16384"]),
    (["fault.grad_spike_window=1e6"], ["fault.grad_spike_window", "10000"]),
    (["training.steps=1.5e0"], ["training.steps", "whole number", "'1.5e0'"]),
    (["training.seed=1e999999999"], ["training.seed", "64 bits"]),
    (["scaling.num_workers=100000"], ["scaling.num_workers", "65536"]),
    (["training.seed=100000000000000000000000"], ["training.seed", "64 bits"]),
    (["data.seed=-1"], ["data.seed"]),
    # fault specs in the config are parsed when it loads
    (['fault.inject=["kil:rank=1,step=5"]'], ["fault.inject", "unknown kind 'kil'"]),
    (['fault.inject=["random:count=-1"]'], ["fault.inject", "count must be >= 1"]),
    # messages that point at the mistake
    (["training.stpes=5"], ["training.stpes", "did you mean training.steps?"]),
    (["steps=5"], ["did you mean training.steps?"]),
    (["u.x=1"], ["u: unknown field"]),  # the section is named even when its name starts the message's words
    (["fault.inject=kill:rank=1,step=5"], ["fault.inject", "YAML list", """--set 'fault.inject=["kill:rank=1,step=5"]'"""]),
    (["training.steps=[1"], ["training.steps", "invalid YAML"]),
    (["training.steps=!!python/name:os.system"], ["training.steps", "invalid YAML"]),
    (["model..dim=3"], ["model..dim", "not a field name"]),
    # layouts that would not be what runs
    (["parallel.dp_shard=3"], ["parallel.dp_shard (3)", "scaling.num_workers (4)"]),
    (["parallel.dp_shard=4", "training.global_batch=6", "training.micro_batch=1"], ["parallel.dp_shard (4)", "does not divide the global batch 6"]),
])
def test_bad_setting_is_one_line_naming_the_field(capsys, sets, needles):
    args = [a for s in sets for a in ("--set", s)]
    assert main(["config", "validate", DEMO, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize("spec, needle", [
    ("random:count=-1", "count must be >= 1"),
    ("random:ranks=0", "ranks must be >= 1"),
    ("random:steps=5-5", "steps must be A-B with 0 <= A < B"),
    ("random:cuont=2", "unknown key 'cuont'"),
    ("random:count=5000", "count must be <= 1000"),
    ("node:rank=1,step=5,back=nan", "back must be a finite number"),
    ("node:rank=1,step=5,back=-1", "back must be a finite number"),
    ("kill:rank=1;step=5", "unexpected ';' in 'rank=1;step=5'"),
    ("kill:rank=1,rank=2,step=5", "rank= is given twice"),
    ("kill:rank=1,step=5,where=collective", "unknown key 'where' for kill"),
    ("kill:rank=9,step=5", "rank 9 never exists: the job's largest layout has 4 ranks"),
    ("kill:rank=1,step=300", "step 300 is never reached: training.steps is 300, and a fault at step S fires before step S+1 runs, "
                             "so the last is step 299"),
    ("kill_during_save:step=301", "step 301 is never reached: training.steps is 300, and the last save is at step 300"),
    ("corrupt:step=300", "step 300 is never reached"),
    ("random:count=3,steps=250-400", "can never fire: step"),
    ("random:count=3,ranks=8,steps=5-6", "can never fire: rank"),
])
def test_bad_inject_spec_is_one_line_naming_the_spec(capsys, spec, needle):
    assert main(["config", "validate", DEMO, "--inject", spec]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--inject {spec!r}" in err and needle in err, err


def test_an_integer_in_exponent_notation_is_the_number_it_spells():
    cfg = load_config(DEMO, ["data.num_samples=1e5", "training.steps=2.5e2", "training.lr=1e-3"])
    assert (cfg.data.num_samples, cfg.training.steps, cfg.training.lr) == (100000, 250, 1e-3)
    assert load_config(data={"checkpoint": {"every_steps": "5E1"}}).checkpoint.every_steps == 50  # so in a YAML file
    assert load_config(DEMO, ["name=1e3"]).name == "1e3"  # a string field keeps the string


MULTI_NODE = str(ROOT / "deploy" / "examples" / "multi-node-3d.yaml")
SIXTY_FOUR_NODES = ["--set", "scaling.workers_per_node=8", "--set", "scaling.num_workers=512", "--set", "scaling.max_workers=512"]


def test_a_job_on_more_nodes_than_the_embedded_ray_simulates_is_refused_only_where_it_would_start_it(tmp_path, capsys, monkeypatch):
    from elastic.job import _refuse_too_many_simulated_nodes

    # 64 nodes of 8 GPUs: a real cluster's (validate also checks the checkpoint URI: a local one here, not the example's bucket)
    assert main(["config", "validate", MULTI_NODE, *SIXTY_FOUR_NODES, "--set", f"checkpoint.uri={tmp_path / 'ckpt'}"]) == 0
    cfg = load_config(MULTI_NODE, SIXTY_FOUR_NODES[1::2])
    _refuse_too_many_simulated_nodes(cfg, "ray://head:10001")  # `elastic run --address`
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # `ray job submit`
    _refuse_too_many_simulated_nodes(cfg, None)
    monkeypatch.delenv("RAY_ADDRESS")
    capsys.readouterr()
    assert main(["run", MULTI_NODE, *SIXTY_FOUR_NODES, "--set", f"run_root={tmp_path}"]) == 2  # it would start the embedded Ray
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "scaling.workers_per_node (8)" in err and "64 simulated nodes" in err and "the 32" in err, err
    assert "RAY_ADDRESS" in err and not any(tmp_path.iterdir())  # refused before anything is claimed


def test_faults_that_can_fire_are_accepted():
    cfg = load_config(DEMO)
    faults = check_job(cfg, ["kill:rank=3,step=299", "kill_during_save:rank=0,step=300", "random:count=4,seed=1,steps=10-290,ranks=4"]).faults
    assert [f.id for f in faults] == list(range(7))  # the demo's own node fault first, then these
    grown = load_config(DEMO, ["scaling.max_workers=6", "training.global_batch=24"])
    assert check_job(grown, ["kill:rank=5,step=5"]).max_world == 6  # rank 5 exists once the job grows to 6


def test_config_validate_names_a_never_firing_fault_of_the_yaml(capsys):
    assert main(["config", "validate", DEMO, "--set", "training.steps=100"]) == 2  # the demo's node fault is at step 140
    assert "fault.inject 'node:rank=3,step=140' can never fire: step 140 is never reached" in capsys.readouterr().err


# --------------------------------------------------------------------------- what is accepted runs
def test_explicit_dp_shard_is_the_layout_that_runs():
    cfg = load_config(DEMO, ["parallel.dp_shard=2", "parallel.dp_replicate=2"])
    assert check_job(cfg).layout == Layout(dp_replicate=2, dp_shard=2)
    decision = ScalingPolicy(cfg).decide(cfg.scaling.num_workers, None)  # what the controller starts with
    assert decision.layout == Layout(dp_replicate=2, dp_shard=2)


def test_validate_prints_the_layout_and_the_idle_workers(capsys):
    sets = ["parallel.tp=2", "scaling.num_workers=3", "scaling.workers_per_node=0", "fault.inject=[]"]
    assert main(["config", "validate", DEMO, *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["layout tp=2 on 2 workers (kept tp=2 pp=1); global batch 32 = dp 1 x 4 micro-batches of 8; "
                   "1 of 3 workers idle (3 is no multiple of tp*pp (2)); the idle workers' slots stay reserved and unused", "OK"]


def test_validate_says_when_the_memory_tier_would_take_no_snapshot(capsys):
    # A snapshot is taken after every memory_every_steps steps but the last (whose durable save is synchronous).
    sets = ["training.steps=300", "fault.inject=[]", "checkpoint.memory=true"]
    for every, silent in ((299, True), (300, False), (1000, False)):
        assert main(["config", "validate", DEMO, *[a for s in [*sets, f"checkpoint.memory_every_steps={every}"] for a in ("--set", s)]]) == 0
        (summary, ok) = capsys.readouterr().out.splitlines()
        assert ok == "OK" and ("the memory tier takes no snapshot" not in summary) == silent, summary


def test_run_prints_the_layout_before_the_job_starts(tmp_path, capsys, monkeypatch):
    import elastic.job

    printed = []

    def run_job(cfg, inject, **kwargs):
        printed.append(capsys.readouterr().out)  # what `elastic run` has printed by the time the job starts
        return {"state": "FINISHED", "steps_completed": 0, "initial_loss": None, "final_loss": None, "world_sizes": [2],
                "samples": None, "goodput": 0.0, "goodput_training": None, "failures": []}

    monkeypatch.setattr(elastic.job, "run_job", run_job)
    sets = ["parallel.tp=2", "scaling.num_workers=3", "scaling.workers_per_node=0", "fault.inject=[]", f"run_root={tmp_path}"]
    assert main(["run", DEMO, *[a for s in sets for a in ("--set", s)]]) == 0
    (layout_line,) = printed[0].splitlines()
    assert layout_line == check_job(load_config(DEMO, sets)).summary and layout_line.startswith("layout tp=2 on 2 workers")
    assert "1 of 3 workers idle" in layout_line


def test_unwritable_checkpoint_uri_is_said_once(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    uri = tmp_path / "f" / "sub"
    code = main(["run", DEMO, "--set", f"checkpoint.uri={uri}", "--set", f"run_root={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"elastic: error: checkpoint.uri {uri} is not writable: "), err
    assert err.count("not writable") == 1 and "checkpoint URI" not in err, err  # the OS error after it names the path it failed at


@pytest.mark.parametrize("sets", [
    ["checkpoint.uri=/proc/nope"],
    ["data.kind=tokens", "data.path=/nonexistent/corpus"],
    ["model.init_from=/nonexistent/weights"],
], ids=["checkpoint.uri", "data.path", "model.init_from"])
def test_validate_refuses_what_run_refuses_before_a_worker_starts(tmp_path, capsys, sets):
    args = [a for s in [*sets, f"run_root={tmp_path}"] for a in ("--set", s)]
    assert main(["config", "validate", DEMO, *args]) == 2
    validate = capsys.readouterr()
    assert main(["run", DEMO, *args]) == 2
    run = capsys.readouterr()
    field = sets[-1].split("=")[0]
    assert validate.err == run.err and validate.err.startswith(f"elastic: error: {field}") and validate.err.count("\n") == 1, (validate, run)
    assert "OK" not in validate.out
    assert list(tmp_path.iterdir()) == []  # validate claimed no run directory, and run refused before it did


def test_validate_leaves_no_directory_behind(tmp_path, capsys):
    ckpt = tmp_path / "a" / "b" / "ckpt"
    assert main(["config", "validate", DEMO, "--set", f"checkpoint.uri={ckpt}", "--set", f"run_root={tmp_path / 'runs'}"]) == 0
    assert capsys.readouterr().out.endswith("OK\n")
    assert list(tmp_path.iterdir()) == []  # the writability probe removed what it created; no run directory was claimed


# --------------------------------------------------------------------------- the run directory
def test_fresh_deletes_only_a_run_directory_elastic_created(tmp_path):
    mine = rundir.claim(str(tmp_path), "job", fresh=False)
    assert (mine / rundir.MARKER).is_file()
    (mine / "events.jsonl").write_text("{}\n")
    assert rundir.claim(str(tmp_path), "job", fresh=True) == mine and not (mine / "events.jsonl").exists()

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    for fresh in (True, False):
        with pytest.raises(ConfigError, match="not empty and was not created by elastic"):
            rundir.claim(str(tmp_path), "notes", fresh=fresh)
    assert (foreign / "thesis.tex").read_text() == "years of work"


def test_fresh_accepts_a_run_directory_of_an_older_version(tmp_path):
    old = tmp_path / "demo"
    (old / "checkpoints" / "step_00000025").mkdir(parents=True)
    (old / "checkpoints" / "step_00000025" / "manifest.json").write_text("{}")
    (old / "checkpoints" / "step_00000030").mkdir()  # a save cut short
    for name in ("events.jsonl", "report.json", "loss.png"):
        (old / name).write_text("x")
    rundir.claim(str(tmp_path), "demo", fresh=True)
    assert sorted(p.name for p in old.iterdir()) == [rundir.MARKER]


def test_run_root_of_slash_or_home_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="run_root '/' is the filesystem root"):
        rundir.claim("/", "etc", fresh=True)
    with pytest.raises(ConfigError, match="is the home directory"):
        rundir.claim(str(tmp_path), "job", fresh=True)
    with pytest.raises(ConfigError, match="is the home directory"):
        rundir.claim(str(tmp_path.parent), tmp_path.name, fresh=True)
    assert Path("/etc").is_dir()


# --------------------------------------------------------------------------- ckpt list
def test_ckpt_list_without_a_creation_time_prints_a_dash(tmp_path, capsys):
    import json

    import torch

    import storage
    from storage.format import MANIFEST, step_dir

    rows = storage.write_shards(str(tmp_path), 10, 0, {"model.w": torch.ones(2)}, generation=1)
    storage.commit(str(tmp_path), 10, rows, generation=1, layout={"dp_shard": 1}, train_state={"step": 10})
    manifest = tmp_path / step_dir(10) / MANIFEST
    data = json.loads(manifest.read_text())
    del data["created_unix"]  # written by an older version, or by hand
    manifest.write_text(json.dumps(data))
    assert main(["ckpt", "list", str(tmp_path)]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[0] == "10" and row[-2:] == ["-", "dp_shard=1"]
