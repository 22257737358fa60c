"""The lease on a checkpoint URI: one live holder, a clear refusal for a second, stale leases taken over, renewal."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

import storage
import storage.lease
from storage.fs import Store
from storage.lease import LEASE_FILE, Lease, LeaseHeld


@pytest.fixture(autouse=True)
def _short_settle(monkeypatch):
    """Acquires here wait 0.1 s before their read-back, not 0.5 s: the races below are between threads of one process."""
    monkeypatch.setattr(storage.lease, "SETTLE_S", 0.1)


def _uri(tmp_path, scheme: str) -> str:
    return f"memory://{tmp_path.name}/ck" if scheme == "memory://" else f"{scheme}{tmp_path}/ck"


def check_lease_semantics(uri: str, ttl_s: float) -> None:
    """What every backend must do (also run against S3 in test_storage_s3.py); `ttl_s` well above an acquire's time."""
    a = Lease(uri, {"job": "job-a"}, ttl_s=ttl_s)
    assert a.acquire() is None
    b = Lease(uri, {"job": "job-b"}, ttl_s=ttl_s)
    with pytest.raises(LeaseHeld, match=rf"/\.lease\.json is held by job=job-a, host=\S+, pid={os.getpid()} \(renewed \d\.\d s ago") as held:
        b.acquire()
    assert held.value.holder["owner"]["job"] == "job-a"
    with pytest.raises(LeaseHeld, match="held by .*job=job-a"):
        b.release()  # not b's lease: refused, and a still holds it
    a.renew()
    time.sleep(ttl_s * 1.2)  # a stops renewing: its lease goes stale
    taken = b.acquire()
    assert taken is not None and taken["owner"]["job"] == "job-a"
    with pytest.raises(LeaseHeld, match="held by .*job=job-b"):
        a.renew()  # a learns that it lost the lease
    with pytest.raises(LeaseHeld, match="held by .*job=job-b"):
        a.release()
    assert b.release() is True and b.release() is False
    assert Lease(uri, {"job": "job-c"}).acquire() is None


@pytest.mark.parametrize("scheme", ["", "memory://"])
def test_second_holder_refused_stale_lease_taken_over(tmp_path, scheme):
    check_lease_semantics(_uri(tmp_path, scheme), ttl_s=1.0)


def check_renewal(uri: str, ttl_s: float) -> None:
    """A renewed lease stays live well past its ttl (also run against S3)."""
    a = Lease(uri, {"job": "job-a"}, ttl_s=ttl_s)
    a.acquire()
    a.start_renewing(every_s=ttl_s / 5)
    time.sleep(ttl_s * 2)
    with pytest.raises(LeaseHeld, match="job=job-a"):
        Lease(uri, {"job": "job-b"}, ttl_s=ttl_s).acquire()
    assert a.lost is None
    a.release()  # stops the renewer too
    assert not Store(uri).exists(LEASE_FILE)


@pytest.mark.parametrize("scheme", ["", "memory://"])
def test_renewal_keeps_the_lease_alive(tmp_path, scheme):
    check_renewal(_uri(tmp_path, scheme), ttl_s=1.0)


def test_renewer_reports_a_lost_lease(tmp_path):
    uri = str(tmp_path)
    a = Lease(uri, {"job": "job-a"}, ttl_s=1.0)
    a.acquire()
    lost = threading.Event()
    a.start_renewing(every_s=0.1, on_lost=lambda exc: lost.set())
    # Someone else's lease appears (as if a had gone stale and been taken over).
    record = json.loads(Store(uri).read(LEASE_FILE))
    Store(uri).write_atomic(LEASE_FILE, json.dumps({**record, "token": "other", "owner": {"job": "job-x"}}).encode())
    assert lost.wait(5)
    assert isinstance(a.lost, LeaseHeld) and "job=job-x" in str(a.lost)
    a.stop()


def test_racing_jobs_exactly_one_wins(tmp_path):
    """Local paths: of many jobs racing for a free lease, then for a stale one, exactly one gets it."""
    uri = str(tmp_path)

    def race(prefix: str) -> list[Lease]:
        leases = [Lease(uri, {"job": f"{prefix}{i}"}, ttl_s=1.0) for i in range(8)]
        winners, go = [], threading.Barrier(len(leases))

        def try_acquire(lease: Lease) -> None:
            go.wait()
            try:
                lease.acquire()
                winners.append(lease)
            except LeaseHeld:
                pass

        threads = [threading.Thread(target=try_acquire, args=(lease,)) for lease in leases]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return winners

    first = race("free-")
    assert len(first) == 1
    time.sleep(1.3)  # the winner never renews: stale
    second = race("stale-")
    assert len(second) == 1
    assert json.loads(Store(uri).read(LEASE_FILE))["token"] == second[0].token
    assert [p.name for p in tmp_path.iterdir()] == [LEASE_FILE]  # no file moved aside is left behind


def test_garbled_lease_is_taken_over(tmp_path):
    Store(str(tmp_path)).write_atomic(LEASE_FILE, b"[" * 100_000)
    assert Lease(str(tmp_path), {"job": "a"}).acquire() == {"garbled": True}


def test_checkpoint_listing_ignores_the_lease(tmp_path):
    uri = str(tmp_path)
    with Lease(uri, {"job": "a"}) as lease:
        rows = storage.write_shards(uri, 1, 0, {"model.w": torch.ones(3)}, generation=1)
        storage.commit(uri, 1, rows, layout={}, train_state={}, generation=1)
        assert Store(uri).list_dirs() == ["step_00000001"]
        assert [c["step"] for c in storage.list_checkpoints(uri)] == [1]
        assert storage.retain(uri, 1) == [] and storage.remove_all(uri) == [1]
        assert storage.clean_incomplete(uri) == [] and storage.latest_valid(uri) is None
        assert json.loads((tmp_path / LEASE_FILE).read_text())["token"] == lease.token
    assert not (tmp_path / LEASE_FILE).exists()


def test_bad_arguments():
    with pytest.raises(ValueError, match="ttl_s must be a positive"):
        Lease("/tmp/x", {}, ttl_s=float("nan"))
    with pytest.raises(TypeError):
        Lease("/tmp/x", {"job": object()})
    lease = Lease("/tmp/x", {}, ttl_s=3)
    with pytest.raises(ValueError, match="every_s must be between 0 and ttl_s"):
        lease.start_renewing(every_s=3)
