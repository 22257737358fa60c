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


def test_failure_policy_limits_and_excludes():
    policy = FailurePolicy(max_failures=3, exclude_after=2)
    hang = Failure("hang", 1, "nodeA", 1, 10)
    assert policy.decide(hang).retry and policy.decide(hang).exclude_node == "nodeA"
    assert policy.decide(Failure("rank_died", 0, "nodeB", 0, 12)).retry
    d = policy.decide(Failure("rank_died", 0, "nodeB", 0, 14))
    assert not d.retry and "max_failures" in d.reason
