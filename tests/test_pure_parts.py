import pytest

from elastic.config import FaultConfig
from elastic.faults import FaultSpecError, parse_faults
from elastic.ledger import SampleLedger
from elastic.policies import Failure, FailurePolicy
from elastic.watchdog import HangWatchdog


def test_parse_faults():
    faults = parse_faults(["kill:rank=1,step=30", "hang:rank=2,step=5,where=collective", "corrupt:step=40"])
    assert [(f.kind, f.rank, f.step) for f in faults] == [("kill", 1, 30), ("hang", 2, 5), ("corrupt", 0, 40)]
    assert [f.id for f in faults] == [0, 1, 2]
    for bad in ["kill", "kill:rank=x,step=1", "boom:step=1", "kill:step=1,color=red", "hang:step=1,where=gpu"]:
        with pytest.raises(FaultSpecError):
            parse_faults([bad])


def test_random_faults_seeded_cover_kinds():
    a = parse_faults(["random:count=10,seed=3,steps=5-200,ranks=4"])
    b = parse_faults(["random:count=10,seed=3,steps=5-200,ranks=4"])
    assert a == b and len(a) == 10
    assert {f.kind for f in a} == {"kill", "node", "hang", "kill_during_save", "corrupt"}
    assert all(5 <= f.step < 200 and 0 <= f.rank < 4 for f in a)


def test_ledger_rollback_and_summary():
    ledger = SampleLedger()
    for step in range(4):
        ledger.record(step, [step * 2, step * 2 + 1], expected=[step * 2, step * 2 + 1])
    ledger.rollback(2)
    assert ledger.steps() == [0, 1]
    assert ledger.summary()["expected"] == 4  # the rolled-back steps' assignments went with them
    for step in range(2, 4):
        ledger.record(step, [step * 2, step * 2 + 1], expected=[step * 2, step * 2 + 1])
    assert ledger.summary(list(range(8))) == {"expected": 8, "seen_once": 8, "duplicated": 0, "missing": 0}
    assert ledger.summary() == ledger.summary(list(range(8)))
    ledger.record(3, [7], expected=[6, 7])
    assert ledger.summary(list(range(9)))["duplicated"] == 1
    assert ledger.summary(list(range(9)))["missing"] == 1
    assert ledger.summary()["duplicated"] == 1  # step 3 counted twice: its samples were seen twice


def test_watchdog_calibrates_after_warmup():
    wd = HangWatchdog(FaultConfig(hang_factor=5, hang_floor_s=1.0, startup_timeout_s=60))
    wd.reset(0.0)
    assert wd.deadline_s("step") == 60
    for i in range(6):
        wd.observe_step(0.5 if i != 4 else 0.8, now=float(i))
    assert wd.deadline_s("step") == pytest.approx(4.0)
    assert not wd.expired(9.0, "step") and wd.expired(9.1, "step")
    assert wd.deadline_s("save") == 120
    explicit = HangWatchdog(FaultConfig(hang_timeout_s=2.5))
    explicit.observe_step(1.0, now=1.0)
    assert explicit.deadline_s("step") == 2.5


def test_watchdog_times_a_restarted_generations_first_step_once_every_rank_is_in_its_loop():
    wd = HangWatchdog(FaultConfig(hang_factor=5, hang_floor_s=1.0, startup_timeout_s=60))
    wd.reset(0.0)
    wd.entered_loop(1.0)
    assert wd.deadline_s("step") == 60  # the job's first generation: nothing calibrated yet
    for i in range(6):
        wd.observe_step(0.5 if i else 0.9, now=2.0 + i)
    wd.reset(10.0)  # a restart: its ranks start up (cold ones import torch) under the start-up budget
    assert wd.deadline_s("step") == 60 and not wd.expired(69.0, "step")
    wd.entered_loop(12.0)
    assert wd.deadline_s("step") == pytest.approx(4.5)  # 5 x the slowest first step (0.9 s), above 5 x 0.5 s
    assert not wd.expired(16.4, "step") and wd.expired(16.6, "step")  # a hang in it is caught in seconds
    wd.entered_loop(15.0)  # once per generation: later polls do not push the deadline back
    assert wd.expired(16.6, "step")


def test_failure_policy_limits_and_excludes():
    policy = FailurePolicy(max_failures=3, exclude_after=2)
    hang = Failure("hang", 1, "nodeA", 1, 10)
    assert policy.decide(hang).retry and policy.decide(hang).exclude_node == "nodeA"
    assert policy.decide(Failure("rank_died", 0, "nodeB", 0, 12)).retry
    d = policy.decide(Failure("rank_died", 0, "nodeB", 0, 14))
    assert not d.retry and "max_failures" in d.reason


def test_a_start_that_fails_with_the_same_raised_error_twice_in_a_row_is_not_retried_again():
    # A setting no node can use fails every start alike: one retry, then the job fails naming the error, instead of
    # fault.max_failures starts that each print it again. The cause leaves out the nodes and processes (they differ
    # from one start to the next) and is empty for what a retry may change: a missed deadline, a dead agent, a
    # rank process slow to start.
    from elastic.worker_group import _start_failure

    unusable = ("ActorDiedError: The actor died because of an error raised in its creation task, ray::NodeAgent.__init__() ... "
                "NotADirectoryError: [Errno 20] checkpoint.memory_dir: cannot make a directory in /x: Not a directory")
    raised = "\x1b[36mray::NodeAgent.prepare()\x1b[39m (pid=12237, ip=127.0.0.1)\n  File \"agent.py\", line 7\nImportError: No module named 'mymodel'"
    first = _start_failure("workers did not start", {"nodeA": unusable, "peer nodeA": unusable, "nodeB": unusable}, 120.0)
    assert first.cause == "NotADirectoryError: [Errno 20] checkpoint.memory_dir: cannot make a directory in /x: Not a directory"
    assert str(first).startswith("workers did not start: ") and str(first).count("checkpoint.memory_dir") == 1
    assert _start_failure("workers did not start", {"nodeA": raised}, 120.0).cause == "ImportError: No module named 'mymodel'"
    late = _start_failure("workers did not start", {"nodeA": unusable, "nodeB": "no answer within 130.0s"}, 120.0)
    assert late.cause == "" and "(fault.startup_timeout_s=120.0s)" in str(late)
    gone = _start_failure("workers could not be given their ranks", {"nodeA": "ActorDiedError: The actor died unexpectedly"})
    slow = _start_failure("workers did not start", {"nodeA": "ray::NodeAgent.prepare() (pid=1)\nTimeoutError: a rank process did not start within 120.0s"})
    assert gone.cause == slow.cause == ""

    policy = FailurePolicy(max_failures=5)
    start = Failure("start_failed", None, None, None, 0, str(first), first.cause)
    assert policy.decide(start).retry
    assert policy.decide(Failure("start_failed", None, None, None, 0, str(late), late.cause)).retry  # no cause: retried
    assert policy.decide(start).retry  # not twice in a row
    d = policy.decide(start)
    assert not d.retry and d.reason == f"start_failed twice in a row with the same error, which a retry would repeat: {first.cause}"


def test_a_generations_first_step_record_wakes_the_poll_at_once_later_ones_in_batches():
    from elastic.train import Progress

    progress = Progress()
    progress.record("ready", start_step=5)
    progress.changed.clear()
    progress.record("step", step=5)  # right after "ready": a recovery is timed to this record
    assert progress.changed.is_set()
    progress.changed.clear()
    progress.record("step", step=6)  # within STEP_REPORT_S of the last wake: it waits for the batch
    assert not progress.changed.is_set()
    assert [r["step"] for r in progress.drain() if r["kind"] == "step"] == [5, 6]


def test_a_warmed_rank_process_builds_its_first_model_without_importing_anything():
    """What a spare pays at start (`rank_process._warm_up`) is not paid again on the recovery path (a fresh process)."""
    import subprocess
    import sys

    code = (
        "import sys, torch, elastic.train\n"
        "from elastic.rank_process import _warm_up\n"
        "from elastic.config import ModelConfig\n"
        "from elastic.recipe import build_model\n"
        "import elastic.model  # the builder's own module: the job's, imported by its first build\n"
        "_warm_up()\n"
        "before = set(sys.modules)\n"
        "build_model(ModelConfig())\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_the_node_agent_and_what_it_commits_import_no_torch():
    """A job starts an agent per node, on the cores its ranks start on: torch (2-3 s of CPU) is the ranks' and their
    fork server's import, not the agent's, which reads, writes and commits checkpoints of its node's memory."""
    import subprocess
    import sys

    code = (
        "import sys, elastic.agent, storage\n"
        "storage.commit, storage.CheckpointError, storage.verify\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
