"""The memory tier: snapshots in node memory every step, replicated to another node, restored into any layout.

The node-side files and the controller's choice of a restore point are tested
in one process; the guarantees (at most one step lost, the replica is what
survives a node loss, a broken or half-written snapshot is never restored)
on an embedded multi-node Ray cluster with real process and node kills.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chaos_checks import rel_diff
from ckpt_utils import full_tensors
from distributed import free_port
from elastic.checkpointing import MemoryTier
from elastic.config import load_config
from elastic.events import EventLog, read_events
from elastic.job import run_job
from elastic.layout import Layout
from elastic.report import memory_tier
from elastic.memory import NodeMemory, free_lock, rows_body, sweep_abandoned
from elastic.replica_link import SECRET_BYTES, ReplicaClient, ReplicaServer
import elastic.sched
from elastic.sched import idle_is_reversible
from elastic.train import Progress, RankSpec, Trainer
import storage
from storage.format import data_file
from storage.fs import FileMaps
from test_ray_elastic import _cfg as ray_cfg
from test_ray_elastic import _clean_ledger


def _cfg(tmp_path, name, **over):
    """test_ray_elastic's job (the durable tier every 8 steps, 32 steps), with the node memory in the test's directory."""
    return ray_cfg(tmp_path, name, **{"checkpoint.memory_dir": str(tmp_path / "node-memory"), **over})


# -- one process ---------------------------------------------------------------------------
def _write(mem: NodeMemory, step: int, rank: int, generation: int = 1, value: float = 1.0) -> list[dict]:
    mem.keep_two(rank, generation, step)
    rows = storage.write_shards(mem.uri, step, rank, {f"model.w{rank}": torch.full((4, 4), value)}, generation=generation)
    mem.finish(step, rank, generation, rows)
    return rows


def _replicate(own: NodeMemory, peer: NodeMemory, step: int, rank: int, body: bytes) -> None:
    """Hold on `peer` a replica of `rank`'s file of `step` on `own`, as its replication link would."""
    data = own.read(step, data_file(rank, 1))
    maps = FileMaps()
    try:
        peer.put_file(step, rank, 1, len(data), lambda view: view.__setitem__(slice(None), data), body, maps)
    finally:
        maps.close()


def test_a_rank_keeps_its_newest_whole_snapshot_and_the_one_it_writes(tmp_path):
    mem = NodeMemory(tmp_path / "node")
    for step in (1, 2, 3):
        _write(mem, step, rank=0)
    _write(mem, 3, rank=1)
    assert sorted(mem.inventory()) == [(1, 2), (1, 3)]
    assert sorted(mem.inventory()[(1, 3)]) == [0, 1]
    # A data file without its rows is a write that did not finish: not held.
    mem.keep_two(0, 1, 4)
    storage.write_shards(mem.uri, 4, 0, {"model.w0": torch.ones(4, 4)}, generation=1)
    assert (1, 4) not in mem.inventory() and sorted(mem.inventory()) == [(1, 3)]


def test_retention_leaves_no_empty_step_directories_when_no_step_commits(tmp_path):
    # Nothing commits (no drop_below: replicas refused, say): the directories of dropped steps go too, or every
    # keep_two would walk a growing list of them. A directory with another rank's file in it stays.
    mem = NodeMemory(tmp_path / "node")
    _write(mem, 1, rank=1)
    for step in range(1, 41):
        _write(mem, step, rank=0)
    assert mem.steps() == [1, 39, 40]
    assert sorted(mem.inventory()) == [(1, 1), (1, 39), (1, 40)]


def test_the_file_retention_drops_is_overwritten_by_the_next_write_unless_a_send_may_still_read_it(tmp_path):
    # The data file that keep_two drops becomes the next step's (the same inode, no rows: not complete), and the
    # write overwrites it in place and cuts it to size. With reuse=False (a replica's send timed out and may still
    # read the old file) it is removed instead, and the next write makes a new one.
    mem = NodeMemory(tmp_path / "node")
    for step in (1, 2):
        _write(mem, step, rank=0)
    old = os.stat(mem.path / "step_00000001" / data_file(0, 1)).st_ino
    mem.keep_two(0, 1, 3)
    moved = mem.path / "step_00000003" / data_file(0, 1)
    assert os.stat(moved).st_ino == old and sorted(mem.inventory()) == [(1, 2)]
    rows = storage.write_shards(mem.uri, 3, 0, {"model.w0": torch.full((2, 2), 3.0)}, generation=1, durable=False)
    mem.finish(3, 0, 1, rows)
    assert os.stat(moved).st_ino == old and moved.stat().st_size == rows[0]["file_bytes"]
    assert mem.verify(3, 0, rows) is None and sorted(mem.inventory()) == [(1, 2), (1, 3)]
    mem.keep_two(0, 1, 4, reuse=False)
    assert not (mem.path / "step_00000004" / data_file(0, 1)).exists()
    assert not (mem.path / "step_00000002" / data_file(0, 1)).exists() and sorted(mem.inventory()) == [(1, 3)]


def test_a_late_replica_drops_nothing_newer_and_no_directory_a_writer_may_use(tmp_path):
    # A replica of step 2 arriving after those of 3 and 4 (out of order) keeps them; a step directory that
    # another rank is writing into (its data/ made, no file yet) is never removed from under it.
    mem = NodeMemory(tmp_path / "node")
    for step in (3, 4):
        _write(mem, step, rank=0)
    (mem.path / "step_00000005" / "data").mkdir(parents=True)
    _write(mem, 2, rank=0)
    assert sorted(mem.inventory()) == [(1, 2), (1, 3), (1, 4)]
    _write(mem, 5, rank=0)
    assert sorted(mem.inventory()) == [(1, 4), (1, 5)] and (mem.path / "step_00000005" / "data").is_dir()


@contextlib.contextmanager
def _link(tmp_path):
    """Two nodes' memory directories and a replication link from the first to the second, closed afterwards."""
    here, there = NodeMemory(tmp_path / "a"), NodeMemory(tmp_path / "b")
    secret = os.urandom(SECRET_BYTES)
    server = ReplicaServer(there, "127.0.0.1", secret)
    client = ReplicaClient(server.address, secret, timeout_s=10)
    try:
        yield here, there, client, server
    finally:
        client.close()
        server.close()


def test_the_replication_link_lands_a_whole_replica_and_refuses_a_stranger(tmp_path):
    # One node's agent streams a rank's finished file to its peer's memory directory over loopback TCP; the replica
    # is complete there (rows after data), byte for byte, with the step records it carries. A connection without
    # the job's secret writes nothing.
    with _link(tmp_path) as (here, there, client, server):
        for step in (1, 2, 3):
            rows = _write(here, step, rank=0, value=float(step))
            here.finish(step, 0, 1, rows, [{"kind": "step", "step": step - 1}])
            client.send(here.file_path(step, rows), step, 0, 1, here.rows_body(step, 0, 1))
        client.send(None, 3, 1, 1, rows_body([], []))  # a rank with nothing to store
        assert sorted(there.inventory()) == [(1, 2), (1, 3)]  # the peer keeps two of each rank's, like the rank
        assert there.inventory()[(1, 3)] == {0: rows, 1: []}
        assert there.step_records(1, 3) == {0: [{"kind": "step", "step": 2}], 1: []}
        assert there.verify(3, 0, rows) is None
        assert (there.path / "step_00000003" / rows[0]["file"]).read_bytes() == here.file_path(3, rows).read_bytes()
        stranger = ReplicaClient(server.address, os.urandom(SECRET_BYTES), timeout_s=10)
        with pytest.raises(ConnectionError):
            stranger.send(here.file_path(3, rows), 4, 0, 1, here.rows_body(3, 0, 1))
        assert (1, 4) not in there.inventory()
        client.send(here.file_path(3, rows), 4, 0, 1, here.rows_body(3, 0, 1))  # the link still works for its own sender
        assert (1, 4) in there.inventory()


def test_a_replica_of_many_chunks_lands_byte_for_byte_and_verifies(tmp_path):
    # A file several of the link's chunks long, received straight into the map of its file on the peer, lands
    # byte for byte (once, a receive buffer reused too early made the demo's replicas fail their CRC-32).
    from elastic.replica_link import _CHUNK
    with _link(tmp_path) as (here, there, client, server):
        here.keep_two(0, 1, 1)
        state = {"model.w": torch.randn(5 * _CHUNK // 4 + 123, generator=torch.Generator().manual_seed(0))}
        rows = storage.write_shards(here.uri, 1, 0, state, generation=1, durable=False)
        here.finish(1, 0, 1, rows)
        client.send(here.file_path(1, rows), 1, 0, 1, here.rows_body(1, 0, 1))
        assert there.verify(1, 0, rows) is None
        assert (there.path / "step_00000001" / rows[0]["file"]).read_bytes() == here.file_path(1, rows).read_bytes()
        # The peer overwrites the files it drops (and keeps their maps): a smaller file, then a larger one, land whole too.
        for step, numel in ((2, 1000), (3, 3 * _CHUNK)):
            here.keep_two(0, 1, step)
            rows = storage.write_shards(here.uri, step, 0, {"model.w": torch.randn(numel)}, generation=1, durable=False)
            here.finish(step, 0, 1, rows)
            client.send(here.file_path(step, rows), step, 0, 1, here.rows_body(step, 0, 1))
            assert there.verify(step, 0, rows) is None


def test_a_replica_the_peer_cannot_store_is_refused_with_the_reason_and_the_link_stays_in_step(tmp_path):
    # Where the receiver cannot store a file (here a directory stands where the file goes; on a node, a full
    # /dev/shm), the sender learns why, and the next file on the same connection lands whole: the refused file's
    # bytes were read off the link.
    with _link(tmp_path) as (here, there, client, _):
        rows = _write(here, 1, rank=0, value=1.0)
        here.finish(1, 0, 1, rows, [])
        there.data_path(1, 0, 1).mkdir(parents=True)
        with pytest.raises(OSError, match="could not store the replica: IsADirectoryError"):
            client.send(here.file_path(1, rows), 1, 0, 1, here.rows_body(1, 0, 1))
        assert (1, 1) not in there.inventory()
        there.data_path(1, 0, 1).rmdir()
        client.send(here.file_path(1, rows), 2, 0, 1, here.rows_body(1, 0, 1))
        assert there.verify(2, 0, rows) is None


@pytest.mark.skipif(not idle_is_reversible(), reason="this process may not lift a thread off SCHED_IDLE")
def test_the_receiving_end_of_the_link_is_idle_until_a_waiting_rank_has_it_lifted(tmp_path, monkeypatch):
    # The peer's rank waits for its replica (elastic.sched): the receiving thread goes to SCHED_BATCH at once, stays
    # there for the lift's length, and is idle again for the files after it.
    monkeypatch.setattr(elastic.sched, "LIFT_MIN_S", 0.5)
    with _link(tmp_path) as (here, there, client, server):
        # Threads are told apart as objects: a thread id of an earlier test's ending thread may be reused by this one.
        before = [t for t in threading.enumerate() if t.name == "replica-in"]

        def send(step):
            rows = _write(here, step, rank=0, value=float(step))
            here.finish(step, 0, 1, rows, [])
            client.send(here.file_path(step, rows), step, 0, 1, here.rows_body(step, 0, 1))

        send(1)
        (tid,) = [t.native_id for t in threading.enumerate() if t.name == "replica-in" and t not in before]
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        server.hurry()
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        send(2)
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        time.sleep(0.6)
        send(3)  # it was waiting for this one when the lift ended; it is idle again before it reads the next
        send(4)
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        assert there.verify(4, 0, there.inventory()[(1, 4)][0]) is None


def test_destroy_removes_the_jobs_files_and_an_emptied_node_directory_but_not_another_jobs(tmp_path):
    jobs = [NodeMemory(tmp_path / "node" / name) for name in ("a", "b")]
    for mem in jobs:
        _write(mem, 1, rank=0)
    jobs[0].destroy()
    assert not jobs[0].path.exists() and jobs[1].inventory()
    jobs[1].destroy()
    assert not (tmp_path / "node").exists()


_HOLDER = """
import sys, time
from elastic.memory import NodeMemory, rows_body
from storage.fs import FileMaps
mem = NodeMemory(sys.argv[1])
mem.claim()
mem.put_file(1, 0, 1, 4096, lambda view: view.__setitem__(slice(None), b"x" * 4096), rows_body([]), FileMaps())
print("held", flush=True)
time.sleep(600)
"""


def _holder(path) -> subprocess.Popen:
    """A process that claims a job's memory directory on a node, as its agent does, writes a file and lives on."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1], env={"PATH": os.environ["PATH"]})
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_killed_agents_memory_is_swept_by_the_next_agent_and_a_live_ones_is_kept(tmp_path):
    root = tmp_path / "elastic-memory"
    killed, live = _holder(root / "node-a" / "job1"), _holder(root / "node-b" / "job2")
    unlocked = NodeMemory(root / "node-b" / "job0")  # no lock file: not known to be abandoned
    _write(unlocked, 1, rank=0)
    try:
        killed.kill()
        killed.wait()
        # The dead agent's files outlive it: nothing but a sweep removes them.
        assert NodeMemory(root / "node-a" / "job1").inventory()
        with pytest.raises(RuntimeError, match=f"held by another live process \\(pid {live.pid}\\)"):
            NodeMemory(root / "node-b" / "job2").claim(timeout_s=0.2)
        assert sweep_abandoned(root) == [root / "node-a" / "job1"]
        assert not (root / "node-a").exists()  # its node's directory went with its last job
        assert NodeMemory(root / "node-b" / "job2").inventory() and unlocked.inventory()
        assert (root / "node-b" / "job2.lock").exists()
    finally:
        live.kill()
        live.wait()
    # An agent of the same job that comes after the killed one claims the directory and keeps what it finds there.
    again = NodeMemory(root / "node-b" / "job2")
    again.claim(timeout_s=5.0)
    assert sweep_abandoned(root) == [] and again.inventory()
    again.destroy()
    assert not (root / "node-b" / "job2.lock").exists() and unlocked.inventory()


def test_a_memory_directory_that_cannot_be_made_is_an_error_naming_the_setting(tmp_path):
    # Claiming retries a directory that a sweep removed in between; one that can never be made (under a file, under
    # /proc) must fail at once, not spin for ever in the agent's constructor (it did, with a hung job).
    (tmp_path / "file").write_text("")
    root = tmp_path / "file" / "elastic-memory"
    with pytest.raises(NotADirectoryError, match=f"checkpoint.memory_dir: cannot make a directory in {root}"):
        NodeMemory(root / "node" / "job").claim(timeout_s=5.0)
    if Path("/proc/self").exists():
        with pytest.raises(FileNotFoundError, match="checkpoint.memory_dir: cannot make a directory in /proc/nope/elastic-memory"):
            NodeMemory("/proc/nope/elastic-memory/node/job").claim(timeout_s=5.0)


def test_elastic_run_with_an_unusable_memory_directory_fails_and_says_why(tmp_path):
    # As a user runs it: the agents cannot start, and the console names the setting and the directory; the second
    # start that fails alike ends the job (not fault.max_failures of them).
    (tmp_path / "file").write_text("")
    path = _job_yaml(tmp_path, "baddir", 3)
    path.write_text(path.read_text().replace(f"memory_dir: {tmp_path / 'mem'}", f"memory_dir: {tmp_path / 'file'}"))
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    result = subprocess.run([sys.executable, "-m", "elastic", "run", str(path), "--set", "fault.max_failures=5"],
                            cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    why = f"checkpoint.memory_dir: cannot make a directory in {tmp_path / 'file' / 'elastic-memory'}: Not a directory"
    starts = [l for l in result.stdout.splitlines() if l.startswith("[failure] start_failed: workers did not start: ")]
    assert len(starts) == 2 and all(why in line for line in starts), result.stdout[-3000:]
    (failed,) = [l for l in result.stdout.splitlines() if l.startswith("[failed]")]
    assert "start_failed twice in a row with the same error" in failed and why in failed


def _job_yaml(tmp_path, name: str, steps: int) -> Path:
    """The demo's job without its fault, keeping its memory tier under `tmp_path/mem`."""
    text = (Path(__file__).resolve().parents[1] / "deploy/examples/demo.yaml").read_text()
    text = text[: text.index("fault:")].replace("name: demo", f"name: {name}").replace("steps: 300", f"steps: {steps}")
    text = text.replace("memory: true}", f"memory: true, memory_dir: {tmp_path / 'mem'}}}")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace("run_root: runs", f"run_root: {tmp_path / 'runs'}"))
    return path


def _lock_free(lock: Path) -> bool:
    fd = free_lock(lock)
    if fd is not None:
        os.close(fd)
    return fd is not None


@pytest.mark.slow
def test_a_job_killed_with_its_driver_leaves_no_memory_behind_once_another_job_starts(tmp_path):
    """`elastic run` SIGKILLed (as an OOM kill would) leaves its snapshots in the nodes' memory; the next job's
    agents remove them, and that job removes its own at its end."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    elastic = [sys.executable, "-m", "elastic", "run"]
    root = tmp_path / "mem" / "elastic-memory"
    first = subprocess.Popen([*elastic, str(_job_yaml(tmp_path, "first", 5000))], cwd=Path(__file__).resolve().parents[1],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(root.glob("*/*/step_*/data/*.bin")):
            assert first.poll() is None and time.monotonic() < deadline, "the first job wrote no memory snapshot"
            time.sleep(0.5)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        locks = list(root.glob("*/*.lock"))
        assert len(locks) == 2  # one per node's agent
        deadline = time.monotonic() + 60
        while not all(_lock_free(lock) for lock in locks):  # Ray ends the dead driver's agents
            assert time.monotonic() < deadline, "the dead job's agents lived on"
            time.sleep(0.5)
        left = [lock.with_suffix("") for lock in locks]
        assert all(d.is_dir() for d in left)  # nothing removed them: their agents died without a shutdown
        second = subprocess.run([*elastic, str(_job_yaml(tmp_path, "second", 3))], cwd=Path(__file__).resolve().parents[1],
                                env=env, capture_output=True, text=True, timeout=180)
        assert second.returncode == 0, second.stderr[-3000:]
        assert not any(d.exists() for d in left) and not list(root.glob("*/*")), list(root.rglob("*"))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)  # what the embedded Ray of the killed driver left running


def test_a_flipped_byte_fails_verification_and_names_the_file(tmp_path):
    mem = NodeMemory(tmp_path / "node")
    rows = _write(mem, 5, rank=2)
    assert mem.verify(5, 2, rows) is None
    assert mem.corrupt(seed=3) == 1
    why = mem.verify(5, 2, rows)
    assert why is not None and "rank_00002" in why and "CRC-32" in why


def test_what_is_older_than_the_floor_or_of_an_earlier_generation_is_dropped(tmp_path):
    mem = NodeMemory(tmp_path / "node")
    for generation, step in ((1, 9), (2, 7), (2, 8)):
        _write(mem, step, rank=0, generation=generation)
    mem.drop_below(2, 8)  # generation 2 restored from durable step 6 and has committed step 8
    assert sorted(mem.inventory()) == [(2, 8)]


def test_a_file_dropped_below_the_floor_waits_for_its_ranks_next_write(tmp_path):
    # With a snapshot every step the commit of step s drops s-1 before the rank writes s+1, so keep_two would find
    # nothing to reuse: drop_below sets the file aside (no rows: it restores nothing, but its memory counts) and the
    # rank's next write overwrites it in place. A spare of an earlier generation goes at the next drop; a write
    # that may reuse nothing (a send may still read) removes the rank's spare, so the node keeps two files a rank.
    mem = NodeMemory(tmp_path / "node")

    def data_files():
        return sorted(str(p.relative_to(mem.path)) for p in mem.path.rglob("*.bin"))

    for step in (1, 2):
        _write(mem, step, rank=0)
    old = os.stat(mem.path / "step_00000001" / data_file(0, 1)).st_ino
    mem.drop_below(1, 2)
    assert sorted(mem.inventory()) == [(1, 2)] and mem.steps() == [2]
    assert data_files() == ["spare/data/g000001-rank_00000.bin", "step_00000002/data/g000001-rank_00000.bin"]
    rows = _write(mem, 3, rank=0, value=3.0)
    assert os.stat(mem.path / "step_00000003" / data_file(0, 1)).st_ino == old
    assert mem.verify(3, 0, rows) is None and sorted(mem.inventory()) == [(1, 2), (1, 3)]
    mem.drop_below(1, 3)
    assert len(data_files()) == 2
    mem.keep_two(0, 1, 4, reuse=False)
    assert data_files() == ["step_00000003/data/g000001-rank_00000.bin"]
    _write(mem, 4, rank=0)
    mem.drop_below(1, 4)
    _write(mem, 5, rank=1, generation=2)
    mem.drop_below(2, 5)
    assert sorted(mem.inventory()) == [(2, 5)] and data_files() == ["step_00000005/data/g000002-rank_00001.bin"]


def test_a_ranks_memory_files_are_written_through_kept_maps_that_never_pin_a_removed_file(tmp_path):
    # The rank's writer overwrites its two files in turn through maps it keeps (storage.fs.FileMaps): the bytes
    # match their checksums at every size, and a map of a file that is gone (the job's directory removed, a
    # spare dropped) is let go at the next write, so it holds no memory after the file.
    mem, maps = NodeMemory(tmp_path / "node"), FileMaps()

    def mapped() -> list[str]:
        return [line for line in open("/proc/self/maps").read().splitlines() if str(mem.path) in line]

    def write(step: int, n: int = 64) -> None:
        mem.keep_two(0, 1, step)
        tensors = {"model.w0": torch.randn(n, n), "model.b0": torch.arange(float(n))}
        rows = storage.write_shards(mem.uri, step, 0, tensors, generation=1, durable=False, maps=maps)
        mem.finish(step, 0, 1, rows)
        assert mem.verify(step, 0, rows) is None

    for step in range(1, 6):
        write(step)
        mem.drop_below(1, step)
    assert len(mapped()) == 2  # the two files the rank writes in turn
    write(6, n=96)  # another size: the file is cut to it and mapped anew
    assert len(mapped()) == 2
    for step in (7, 8):
        write(step, n=96)
    shutil.rmtree(mem.path)
    write(9)
    assert len(mapped()) == 1 and "(deleted)" not in mapped()[0]
    maps.close()
    assert mapped() == []


def test_a_memory_directory_whose_filesystem_cannot_map_files_is_written_without_maps(tmp_path, monkeypatch):
    # checkpoint.memory_dir may be on a filesystem without shared maps (some FUSE and network ones refuse mmap with
    # ENODEV). The rank's writes, and the replicas its agent receives, then go through a buffer and a write, and
    # still match their checksums.
    import errno
    import mmap

    import storage.fs

    def refused(*args, **kwargs):
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(storage.fs.mmap, "mmap", refused)
    mem, maps = NodeMemory(tmp_path / "node"), FileMaps()
    for step in range(1, 4):
        mem.keep_two(0, 1, step)
        tensors = {"model.w0": torch.randn(48, 48), "model.b0": torch.arange(48.0)}
        rows = storage.write_shards(mem.uri, step, 0, tensors, generation=1, durable=False, maps=maps)
        mem.finish(step, 0, 1, rows)
        assert mem.verify(step, 0, rows) is None
        mem.drop_below(1, step)
    body = os.urandom(5000)
    mem.put_file(3, 1, 1, len(body), lambda view: view.__setitem__(slice(None), body), rows_body([]), maps)
    assert (mem.data_path(3, 1, 1)).read_bytes() == body
    monkeypatch.setattr(storage.fs.mmap, "mmap", mmap.mmap)
    assert not [line for line in open("/proc/self/maps").read().splitlines() if str(mem.path) in line]


class _Agents:
    """The worker group's memory surface over NodeMemory directories, one per simulated node."""

    def __init__(self, nodes: dict[str, NodeMemory]):
        self.nodes = nodes

    def memory_inventory(self):
        return {n: m.inventory() for n, m in self.nodes.items()}

    def memory_verify(self, step, files):
        out = {}
        for node, per_rank in files.items():
            for rank, rows in per_rank.items():
                if why := self.nodes[node].verify(step, rank, rows):
                    out[(node, rank)] = why
        return out


def _tier(tmp_path, world=2):
    events = EventLog(tmp_path / "events.jsonl")
    cfg = _cfg(tmp_path, "unit", **{"checkpoint.memory": "true"})
    tier = MemoryTier(cfg, events)
    tier.begin_generation(1, {"pp": 1, "dp_replicate": 1, "dp_shard": world, "tp": 1}, world)
    return tier, events


def test_a_run_of_failed_snapshots_is_one_warning_and_one_count_per_rank(tmp_path):
    tier, events = _tier(tmp_path)
    for step in range(2, 9):
        for rank in (0, 1):
            if rank == 0 or step < 5:  # rank 1's snapshots work again from step 5 on
                tier.on_failed(rank, {"step": step, "error": "OSError: [Errno 28] No space left on device"})
            else:
                tier.on_saved(rank, {"step": step, "rank": rank, "bytes": 8, "save_s": 0.0, "replicated": True})
    assert [(e["rank"], e["step"]) for e in events.of("warning")] == [(0, 2), (1, 2)]
    assert [(e["rank"], e["first_step"], e["last_step"], e["failed"]) for e in events.of("memory_snapshots_failed")] == [(1, 2, 4, 3)]
    tier.on_failed(1, {"step": 9, "error": "OSError: [Errno 5] Input/output error"})  # a new run: warned again
    tier.close()  # the job ends: the runs still going are counted
    tier.close()
    assert [(e["rank"], e["step"]) for e in events.of("warning")] == [(0, 2), (1, 2), (1, 9)]
    runs = [(e["rank"], e["first_step"], e["last_step"], e["failed"]) for e in events.of("memory_snapshots_failed")]
    assert runs == [(1, 2, 4, 3), (0, 2, 8, 7), (1, 9, 9, 1)]
    assert memory_tier(True, 1, events.events)["snapshots_failed"] == 11


@pytest.fixture
def full_memory_dir(tmp_path):
    """A RAM-backed filesystem of 1 MiB: too small for the demo job's snapshots (skipped where tmpfs cannot be mounted)."""
    path = tmp_path / "small-shm"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_memory_directory_too_small_warns_once_a_rank_says_why_and_training_goes_on(tmp_path, full_memory_dir):
    cfg = _cfg(tmp_path, "full", **{"checkpoint.memory": "true", "checkpoint.memory_dir": str(full_memory_dir), "training.steps": 12})
    report = run_job(cfg, [], quiet=True)
    assert report["state"] == "FINISHED" and report["steps_completed"] == 12
    _clean_ledger(report)
    events = read_events(cfg.run_dir / "events.jsonl")
    warned = [e for e in events if e["event"] == "warning" and e["kind"] == "memory_snapshot_failed"]
    assert 1 <= len(warned) <= 4  # the ranks whose snapshots did not fit, each once
    assert all("No space left on device" in e["message"] and f"the memory directory {full_memory_dir / 'elastic-memory'} (1.0 MiB"
               in e["message"] and "checkpoint.memory_dir" in e["message"] for e in warned), warned[0]["message"]
    runs = [e for e in events if e["event"] == "memory_snapshots_failed"]  # each warned run, with its count
    assert sorted((e["rank"], e["first_step"]) for e in runs) == sorted((e["rank"], e["step"]) for e in warned)
    assert all(1 <= e["failed"] <= e["last_step"] - e["first_step"] + 1 for e in runs)
    assert report["memory_tier"]["snapshots_failed"] == sum(e["failed"] for e in runs) > len(runs)


def test_restore_takes_the_newest_step_whole_somewhere_and_a_replica_covers_a_lost_node(tmp_path):
    a, b = NodeMemory(tmp_path / "a"), NodeMemory(tmp_path / "b")
    for step in (6, 7):
        for rank, own, peer in ((0, a, b), (1, b, a)):
            rows = _write(own, step, rank)
            _replicate(own, peer, step, rank, rows_body(rows))
    _write(a, 8, rank=0)  # rank 1 died writing step 8: not whole anywhere
    tier, events = _tier(tmp_path)
    point = tier.find(_Agents({"b": b}), newer_than=4, train_state=lambda s: {"step": s, "data": {"position": 16 * s}})
    assert point.tier == "memory" and point.step == 7 and point.memory["train_state"]["data"]["position"] == 112
    assert point.memory["holders"] == {0: "b", 1: "b"}  # node a is gone: rank 0's file is its replica on b
    assert tier.find(_Agents({"a": a, "b": b}), newer_than=8, train_state=lambda s: {}) is None  # the durable step is newer


def test_a_step_past_the_controllers_records_is_restored_only_when_its_files_fill_them_in(tmp_path):
    # Node a is gone with its ranks' records of the last steps: the controller holds every record up to step 6
    # (upto), the snapshot of step 7 survives whole on b. Step 7 is taken when the records its files carry
    # complete the controller's; otherwise step 6, whose records it holds.
    a, b = NodeMemory(tmp_path / "a"), NodeMemory(tmp_path / "b")
    for step in (6, 7):
        for rank, own, peer in ((0, a, b), (1, b, a)):
            rows = _write(own, step, rank)
            records = [{"kind": "step", "step": step - 1, "rank": rank}]
            own.finish(step, rank, 1, rows, records)
            _replicate(own, peer, step, rank, rows_body(rows, records))
    agents = _Agents({"b": b})
    agents.memory_records = lambda generation, step, holders: {
        r: b.step_records(generation, step)[r] for r, node in holders.items() if node == "b"}
    tier, _ = _tier(tmp_path)
    offered = []

    def fill(records, step, ok):
        offered.append((step, records))
        return ok

    point = tier.find(agents, None, lambda s: {}, upto=6, fill=lambda r, s: fill(r, s, True))
    assert point.step == 7 and offered == [(7, {0: [{"kind": "step", "step": 6, "rank": 0}], 1: [{"kind": "step", "step": 6, "rank": 1}]})]
    point = tier.find(agents, None, lambda s: {}, upto=6, fill=lambda r, s: fill(r, s, False))
    assert point.step == 6 and [s for s, _ in offered] == [7, 7]


def test_a_generation_rolled_back_to_the_durable_tier_is_never_restored_from(tmp_path):
    # Generation 1 got to step 9 in memory, then every copy went bad and generation 2 resumed from durable step 4:
    # its own snapshots (5) are the history the ledger follows; generation 1's step 9 is not.
    mem = NodeMemory(tmp_path / "a")
    for rank in (0, 1):
        _write(mem, 9, rank, generation=1)
        _write(mem, 5, rank, generation=2)
    tier, _ = _tier(tmp_path)
    tier.begin_generation(2, {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1}, 2)
    point = tier.find(_Agents({"a": mem}), newer_than=4, train_state=lambda s: {"data": {"position": s}})
    assert (point.step, point.memory["generation"]) == (5, 2)


def test_a_generation_resumed_at_a_resize_can_restore_the_snapshot_the_resize_stopped_at(tmp_path):
    # Generation 1 (2 ranks) wrote step 12 in memory, stopped there for a resize and saved it durably; generation 2
    # (4 ranks) resumed from that durable checkpoint, and its first snapshot (13) is not whole. Generation 1's step
    # 12 is the same state: a restore takes it (the durable checkpoint of 12 may be the one that broke). A generation
    # resumed from a durable step of which the one before has no whole snapshot has no such origin.
    mem = NodeMemory(tmp_path / "a")
    tier, _ = _tier(tmp_path)
    for rank in (0, 1):
        _write(mem, 12, rank, generation=1)
    _write(mem, 13, 0, generation=2)
    tier.begin_generation(2, {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}, 4, resume_step=12)
    point = tier.find(_Agents({"a": mem}), newer_than=10, train_state=lambda s: {"data": {"position": s}})
    assert (point.step, point.memory["generation"], point.memory["layout"]["dp_shard"]) == (12, 1, 2)
    tier.begin_generation(3, {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}, 4, resume_step=10)
    assert tier.find(_Agents({"a": mem}), newer_than=10, train_state=lambda s: {}) is None


def test_a_corrupt_copy_is_skipped_for_another_and_no_good_copy_means_durable(tmp_path):
    a, b = NodeMemory(tmp_path / "a"), NodeMemory(tmp_path / "b")
    for rank, own, peer in ((0, a, b), (1, b, a)):
        rows = _write(own, 3, rank)
        _replicate(own, peer, 3, rank, rows_body(rows))
    tier, events = _tier(tmp_path)
    a.corrupt(seed=1)
    point = tier.find(_Agents({"a": a, "b": b}), newer_than=None, train_state=lambda s: {"data": {"position": 0}})
    assert point.step == 3 and point.memory["holders"] == {0: "b", 1: "b"}
    assert {e["node"] for e in events.of("memory_snapshot_skipped")} == {"a"}
    b.corrupt(seed=2)
    assert tier.find(_Agents({"a": a, "b": b}), newer_than=None, train_state=lambda s: {}) is None
    (unavailable,) = events.of("memory_restore_unavailable")
    assert "durable" in unavailable["reason"]


# -- on an embedded Ray cluster ---------------------------------------------------------------
def test_kills_and_a_node_loss_cost_at_most_one_step_from_memory_into_another_layout(tmp_path):
    # pp=2 x tp=2 on 4 workers (2 nodes). A kill and a kill while writing a memory snapshot keep the layout;
    # the node loss leaves 2 workers, so the last restore goes into another layout. The durable tier saves
    # every 8 steps: without the memory tier these failures would lose 2, 3 and 3 steps.
    layout = {"parallel.pp": 2, "parallel.tp": 2}
    ref = run_job(_cfg(tmp_path, "ref", **layout), quiet=True)
    inject = ["kill:rank=1,step=10", "kill_during_save:rank=2,step=19", "node:rank=3,step=27"]
    cfg = _cfg(tmp_path, "mem", **layout, **{"checkpoint.memory": "true"})
    hit = run_job(cfg, inject, quiet=True)
    assert ref["state"] == hit["state"] == "FINISHED", hit["reason"]
    assert [f["kind"] for f in hit["failures"]] == ["kill", "kill_during_save", "node"]
    tiers = [f["restored_from"] for f in hit["failures"]]
    assert tiers[:2] == ["memory"] * 2 and tiers[2] in ("memory", "durable"), tiers
    # A node loss can take its ranks' last step records with it; a restore never goes past the records the
    # controller holds, so it may fall back to the durable tier (README, "What a failure costs").
    assert all(f["lost_steps"] <= 1 for f in hit["failures"] if f["restored_from"] == "memory"), hit["failures"]
    # Survivors stuck in a collective with the dead rank have their collectives aborted and are kept warm, not
    # replaced by cold processes (the kills leave 3 survivors, the node loss 2).
    kept = [e["workers_kept"] for e in read_events(cfg.run_dir / "events.jsonl") if e["event"] == "recovering"]
    assert kept == [3, 3, 2], kept
    # The rank died writing snapshot 19: that step is not whole, the one before it is what came back.
    assert hit["failures"][1]["resume_step"] == 18
    assert hit["world_sizes"] == [4, 4, 4, 2] and hit["layouts"][-1] != hit["layouts"][0]
    _clean_ledger(hit)
    assert hit["losses"][:26] == ref["losses"][:26]  # bit-exact while the layout is the same (resumed at 26 on 2 workers)
    assert max(abs(a - b) / abs(b) for a, b in zip(hit["losses"], ref["losses"])) < 1e-5
    got, want = full_tensors(str(tmp_path / "mem" / "ckpt"), 32), full_tensors(str(tmp_path / "ref" / "ckpt"), 32)
    assert got.keys() == want.keys() and max(rel_diff(got[k], want[k]) for k in want) <= 1e-5
    memory = hit["memory_tier"]
    assert memory["restores"] == tiers.count("memory") and memory["snapshots_committed"] >= 28 and memory["state_bytes"] > 0
    assert memory["held_bytes_bound"] == memory["state_bytes"] * 4
    # Replicated on two nodes; the generation left on one node after the node loss has no other node to replicate to.
    assert 0 < memory["snapshots_replicated"] < memory["snapshots_committed"], memory
    assert not any((tmp_path / "node-memory" / "elastic-memory").glob("*/*")), "the job leaves no snapshot behind"


def test_a_node_lost_with_its_replica_holder_falls_back_to_the_durable_tier(tmp_path):
    # Three one-worker nodes in a ring: rank 0's replicas live on rank 1's node, and both nodes go at once.
    sets = {"checkpoint.memory": "true", "scaling.num_workers": 3, "scaling.min_workers": 1, "scaling.workers_per_node": 1,
            "training.global_batch": 12, "training.micro_batch": 4, "training.steps": 16}
    cfg = _cfg(tmp_path, "pair", **sets)
    report = run_job(cfg, ["node:rank=0,step=12,peer=1"], quiet=True)
    assert report["state"] == "FINISHED", report["reason"]
    (failure,) = report["failures"]
    assert failure["kind"] == "node" and failure["restored_from"] == "durable" and failure["resume_step"] == 8
    assert failure["lost_steps"] == 12 - 8
    assert report["world_sizes"] == [3, 1]
    events = read_events(cfg.run_dir / "events.jsonl")
    (why,) = [e["reason"] for e in events if e["event"] == "memory_restore_unavailable"]
    assert "lacks ranks [0]" in why and "durable" in why
    s = report["samples"]
    assert s["missing"] == 0 and s["duplicated"] == 0 and s["seen_once"] == s["expected"] == 16 * 12


def test_a_restore_moves_only_the_bytes_each_node_lacks_of_what_its_ranks_read(tmp_path):
    # Three one-worker nodes in a ring: each holds its rank's file and its predecessor's replica, so each lacks one of
    # the three files. After a kill at the same layout every rank reads its own shards (on its node) and the pieces of
    # replicated tensors, which the three files share out (storage.state.is_writer): each node fetches those few
    # bytes of the file it lacks, not the file. After a node loss the job goes on at two workers, whose ranks read
    # parts of the three files, each fetched into its hollow stand-in where the node lacks it.
    sets = {"checkpoint.memory": "true", "scaling.num_workers": 3, "scaling.min_workers": 1, "scaling.workers_per_node": 1,
            "training.global_batch": 12, "training.micro_batch": 2, "training.steps": 16}
    ref = run_job(_cfg(tmp_path, "ref", **sets), quiet=True)
    cfg = _cfg(tmp_path, "hit", **sets)
    hit = run_job(cfg, ["kill:rank=1,step=6", "node:rank=1,step=12"], quiet=True)
    assert ref["state"] == hit["state"] == "FINISHED", hit["reason"]
    kill, node = hit["failures"]
    assert [kill["restored_from"], node["restored_from"]] == ["memory"] * 2 and kill["lost_steps"] <= 1 and node["lost_steps"] <= 1
    assert hit["world_sizes"] == [3, 3, 2]
    pulls = [e for e in read_events(cfg.run_dir / "events.jsonl") if e["event"] == "memory_pulled"]
    after_kill = [e for e in pulls if e["step"] == kill["resume_step"]]
    # Each node lacks one file, or two where the restored step's newest file had not reached its replica holder yet
    # when the kill came (a step is restorable once each of its files is whole somewhere, replicated or not); a
    # rank's own file is always on its node.
    assert sorted(e["rank"] for e in after_kill) == [0, 1, 2], pulls
    assert all(1 <= len(e["files"]) <= 2 and data_file(e["rank"], 1) not in e["files"] for e in after_kill), pulls
    moved, state = sum(e["pulled_bytes"] for e in after_kill), hit["memory_tier"]["state_bytes"]
    assert 0 < moved < state / 20, (moved, state)  # whole files would be the whole state (one file of three per node)
    assert sum(e["pulled_bytes"] for e in pulls if e["step"] == node["resume_step"]) > state / 20  # real shards, resharded
    # What was pulled, and read in place, is the state bit for bit: every step up to the node loss's restore point (the
    # step the node loss came at is run again at 2 workers where its memory step had not committed yet).
    kept = node["resume_step"]
    assert kept >= 11 and hit["losses"][:kept] == ref["losses"][:kept]
    assert max(abs(a - b) / abs(b) for a, b in zip(hit["losses"], ref["losses"])) < 1e-5
    got, want = full_tensors(str(tmp_path / "hit" / "ckpt"), 16), full_tensors(str(tmp_path / "ref" / "ckpt"), 16)
    assert got.keys() == want.keys() and max(rel_diff(got[k], want[k]) for k in want) <= 1e-5


def test_a_node_excluded_for_its_hangs_still_serves_its_memory_snapshot(tmp_path):
    # Rank 1 hangs twice on its node, so the failure policy excludes the node (two hangs blamed on it). The node
    # is up, and with no replicas its agent holds the only copy of ranks 0 and 1's files of the newest memory
    # step: the second restore reads them from it, into 2 workers on the other node, and loses at most one step
    # (the durable tier, every 8 steps, would lose 5). The kill that follows restores from the other node alone:
    # the excluded node's agent then shuts down, taking its files out of that node's memory.
    sets = {"checkpoint.memory": "true", "checkpoint.memory_replicas": 0, "fault.hang_floor_s": 3.0}
    cfg = _cfg(tmp_path, "excluded", **sets)
    report = run_job(cfg, ["hang:rank=1,step=6,where=data", "hang:rank=1,step=13,where=data", "kill:rank=0,step=20"], quiet=True)
    assert report["state"] == "FINISHED", report["reason"]
    assert [f["kind"] for f in report["failures"]] == ["hang", "hang", "kill"]
    excluded = report["failures"][0]["node"]
    assert report["failures"][1]["node"] == excluded != report["failures"][2]["node"]
    events = read_events(cfg.run_dir / "events.jsonl")
    reasons = [e["reason"] for e in events if e["event"] == "recovering"]
    assert "excluding node" in reasons[1] and "excluding node" not in reasons[0], reasons
    assert [f["restored_from"] for f in report["failures"]] == ["memory"] * 3, report["failures"]
    assert all(f["lost_steps"] <= 1 for f in report["failures"]), report["failures"]
    assert report["world_sizes"] == [4, 4, 2, 2]
    _clean_ledger(report)
    assert not any((tmp_path / "node-memory" / "elastic-memory").glob("*/*")), "the job leaves no snapshot behind"


def test_a_job_left_on_one_node_keeps_its_replicas_on_another_node_that_is_up(tmp_path):
    # Two hangs exclude rank 1's node, so the job goes on at 2 workers, all on the other node. That node's snapshots
    # are replicated to the excluded node, which is up (its agent and memory still serve, only its ranks are gone):
    # when the job's node is lost too, its newest memory step survives there, and the ranks on the node that comes
    # back restore it, losing at most one step (the durable tier, every 8 steps, would lose 4).
    cfg = _cfg(tmp_path, "spare", **{"checkpoint.memory": "true", "fault.hang_floor_s": 3.0})
    inject = ["hang:rank=1,step=6,where=data", "hang:rank=1,step=13,where=data", "node:rank=0,step=20,back=1"]
    report = run_job(cfg, inject, quiet=True)
    assert report["state"] == "FINISHED", report["reason"]
    assert [f["kind"] for f in report["failures"]] == ["hang", "hang", "node"]
    excluded = report["failures"][0]["node"]
    assert report["failures"][1]["node"] == excluded != report["failures"][2]["node"]
    assert [f["restored_from"] for f in report["failures"]] == ["memory"] * 3, report["failures"]
    assert all(f["lost_steps"] <= 1 for f in report["failures"]), report["failures"]
    assert report["world_sizes"] == [4, 4, 2, 2]
    events = read_events(cfg.run_dir / "events.jsonl")
    one_node = [e for e in events if e["event"] == "memory_committed" and e["generation"] == 3]
    assert one_node and all(e["replicated"] for e in one_node), one_node  # the one-node generation's steps had replicas
    _clean_ledger(report)
    assert not any((tmp_path / "node-memory" / "elastic-memory").glob("*/*")), "the job leaves no snapshot behind"


def test_a_snapshots_copy_waits_for_the_optimizer_step_it_follows_not_for_the_next_steps_work(tmp_path, monkeypatch):
    # On a GPU a memory snapshot is copied to pinned host memory on a side stream, which first waits for an event
    # marking the optimizer step's kernels done (storage.compute_done). The event must be taken on the training
    # thread right after that step: taken later on the snapshot writer's thread, it would also wait for the next
    # step's forward and backward, queued meanwhile. On the CPU the event is None; which thread asks is the contract
    # this checks, with the real Trainer on a gloo world of one.
    cfg = load_config(None, [f"checkpoint.uri={tmp_path / 'ckpt'}", "checkpoint.memory=true", "checkpoint.memory_replicas=0",
                             f"checkpoint.memory_dir={tmp_path / 'memory'}", "training.steps=5", "training.global_batch=4",
                             "training.micro_batch=4", "scaling.num_workers=1"])
    node = NodeMemory(tmp_path / "memory" / "node" / "job")
    spec = RankSpec(config=cfg.model_dump(mode="json"), layout=Layout().as_dict(), rank=0, generation=1, memory_dir=node.uri)
    asked: list[str] = []
    real = storage.state.compute_done

    def compute_done(tensors):
        asked.append(threading.current_thread().name)
        return real(tensors)

    monkeypatch.setattr(storage, "compute_done", compute_done)
    monkeypatch.setattr(storage.state, "compute_done", compute_done)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        progress = Progress()
        trainer = Trainer(spec, progress)
        runner = threading.Thread(target=trainer.run, name="training", daemon=True)
        runner.start()
        runner.join(120)
        assert not runner.is_alive()
    finally:
        dist.destroy_process_group()
    saved = [r["step"] for r in progress.drain() if r["kind"] == "mem_saved"]
    assert saved == [1, 2, 3, 4], saved  # a snapshot after every step but the last (the durable save has it)
    assert len(asked) >= len(saved) and set(asked) == {"training"}, asked  # (the final durable save asks too)
    assert sorted(node.inventory()) == [(1, 3), (1, 4)]


_COPY_STATE = """
torch.manual_seed(7)
# Pieces smaller than a block and one of many blocks (storage.copy_out.BLOCK), and one that is not contiguous.
state = {"model.a": torch.randn(1000, 300), "model.b": torch.randn(7), "model.c": torch.randn(1200, 900),
         "model.d": torch.randn(64, 48).t()}
"""


def _copy_in(root: str, pid: int, gone: int, size: int, regions: list, heads: list[str]) -> dict:
    """An agent's copier, in a process of its own: copy step 5 of rank 3 (generation 2) out of process `pid`'s memory
    into a node's memory at `root`, then try step 6 from process `gone`, which has ended."""
    from elastic.messages import CopyOut
    from storage.copy_out import CopyRefused

    copied, maps = NodeMemory(root), FileMaps()
    regions = [tuple(r) for r in regions]
    copied.copy_in(pid, CopyOut(2, 5, 3, size, regions, heads, [{"kind": "step", "step": 4}], True, time.time()), heads, maps)
    try:
        copied.copy_in(gone, CopyOut(2, 6, 3, size, regions, heads, [], True, time.time()), heads, maps)
        error = None
    except OSError as exc:
        error = [str(exc), isinstance(exc, CopyRefused)]
    maps.close()
    return {"error": error}


def test_a_snapshot_copied_out_of_a_ranks_memory_is_the_file_the_rank_would_write(tmp_path):
    # The node agent copies a CPU rank's snapshot straight out of the rank's memory (storage.copy_out): the same
    # bytes and rows, checksums included, as the rank's own write. This process is the rank; the copier runs in a
    # fresh one (as an agent does). A copy from a process that has ended fails, naming it, and is not taken for a
    # kernel that refuses such copies (which would make the rank write its own); it leaves no rows.
    scope = {"torch": torch}
    exec(_COPY_STATE, scope)
    state = scope["state"]
    plan = storage.plan_copy(state, 3, 2, {})
    own = NodeMemory(tmp_path / "own")
    rows = _write_state(own, state)
    ended = subprocess.Popen(["true"])
    ended.wait()
    tests = Path(__file__).resolve().parent
    args = [str(tmp_path / "copied"), os.getpid(), ended.pid, plan.size, plan.regions, plan.template.heads()]
    code = f"import json, test_memory_tier as t; print(json.dumps(t._copy_in(*json.loads({json.dumps(json.dumps(args))}))))"
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": f"{tests}{os.pathsep}{tests.parent}"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    copied = NodeMemory(tmp_path / "copied")
    assert copied.read(5, data_file(3, 2)) == own.read(5, data_file(3, 2))
    assert copied.inventory() == {(2, 5): {3: rows}}
    assert copied.verify(5, 3, rows) is None and copied.step_records(2, 5) == {3: [{"kind": "step", "step": 4}]}
    message, refused = result["error"]
    assert f"process {ended.pid}" in message and not refused
    assert copied.complete_ranks(2, 6) == set()  # no rows: never taken for a snapshot


def _write_state(mem: NodeMemory, tensors: dict) -> list[dict]:
    mem.keep_two(3, 2, 5)
    rows = storage.write_shards(mem.uri, 5, 3, tensors, generation=2, durable=False)
    mem.finish(5, 3, 2, storage.rows_json(rows), [{"kind": "step", "step": 4}])
    return rows


def _train_with_a_copier(root: str, refuse_at: int | None) -> dict:
    """The real Trainer on a gloo world of one, its memory snapshots copied out of its memory by an agent's copier
    (NodeMemory.copy_in on a thread of its own, reading this process); the copy of `refuse_at` is refused as a
    kernel would (storage.copy_out.CopyRefused). Run in a process of its own: what it returns, as JSON."""
    import hashlib

    from elastic.messages import Copied
    from elastic.train import Control
    from storage.copy_out import CopyRefused

    root = Path(root)
    cfg = load_config(None, [f"checkpoint.uri={root / 'ckpt'}", "checkpoint.memory=true", "checkpoint.memory_replicas=0",
                             f"checkpoint.memory_dir={root / 'memory'}", "training.steps=6", "training.global_batch=4",
                             "training.micro_batch=4", "scaling.num_workers=1", "checkpoint.every_steps=100"])
    node = NodeMemory(root / "memory" / "node" / "job")
    spec = RankSpec(config=cfg.model_dump(mode="json"), layout=Layout().as_dict(), rank=0, generation=1, memory_dir=node.uri)
    progress, maps, writers, heads, asked, hurried = Progress(), FileMaps(), set(), {}, [], []

    def copy_out(message):
        answer = Future()
        asked.append(message.step)
        heads["now"] = message.heads or heads["now"]
        writers.update(t.name for t in threading.enumerate() if t.name.startswith("memory-writer"))

        def copy():
            try:
                if message.step == refuse_at:
                    raise CopyRefused(1, "cannot read the memory of process 1: Operation not permitted")
                if message.step == 3:
                    time.sleep(1.0)  # a starved copier: the rank must wait for it, and says so (Control.hurry)
                node.copy_in(os.getpid(), message, heads["now"], maps)
                progress.record("mem_saved", step=message.step, rank=0, bytes=message.size, has_file=True, save_s=0.0)
                answer.set_result(Copied(1, message.step))
            except CopyRefused as exc:
                answer.set_result(Copied(1, message.step, node.describe_failure(exc), refused=True))

        threading.Thread(target=copy, name="copier").start()
        return answer

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        trainer = Trainer(spec, progress, control=Control(copy_out=copy_out, hurry=hurried.append))
        finished = trainer.run()
        state = hashlib.sha256()
        for key, value in sorted(storage.state_tensors(trainer.pm.model_parts, trainer.optimizer).items()):
            state.update(key.encode() + getattr(value, "_local_tensor", value).contiguous().numpy().tobytes())
    finally:
        dist.destroy_process_group()
        maps.close()
    records = progress.drain()
    rows = node.inventory().get((1, 5), {}).get(0)
    return {
        "finished": finished, "asked": asked, "hurried": hurried, "writers": sorted(writers), "state": state.hexdigest(),
        "saved": [r["step"] for r in records if r["kind"] == "mem_saved"],
        "failed": [[r["step"], r["error"]] for r in records if r["kind"] == "mem_failed"],
        "held": [list(k) for k in sorted(node.inventory())], "verify": node.verify(5, 0, rows) if rows else "no rows",
        "file": str(node.data_path(5, 0, 1)),
    }


def test_a_ranks_snapshots_are_copied_out_by_its_agent_and_written_by_the_rank_where_the_kernel_refuses(tmp_path):
    # The real Trainer with an agent's copier reading its memory (_train_with_a_copier, in a fresh process: a copy
    # into this one's memory is not what a test should risk): every snapshot but the last step's is complete and
    # verifies, each copy is answered before the optimizer step that follows it changes the tensors (a copied file
    # is byte for byte the file the rank writes itself of the same step), and no thread of the rank writes them.
    # Where the kernel refuses the copy, that step is reported failed and the rank writes the next ones itself.
    runs = {}
    for refuse_at in (None, 2):
        root = tmp_path / f"refuse-{refuse_at}"
        code = f"import json, test_memory_tier as t; print(json.dumps(t._train_with_a_copier({str(root)!r}, {refuse_at!r})))"
        tests = Path(__file__).resolve().parent
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": f"{tests}{os.pathsep}{tests.parent}"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[refuse_at] = run = json.loads(done.stdout.strip().splitlines()[-1])
        assert run["finished"] and run["writers"] == []  # while the agent copies, no thread of the rank writes
        assert run["held"] == [[1, 4], [1, 5]] and run["verify"] is None
        if refuse_at:
            assert run["saved"] == [1, 3, 4, 5] and run["asked"] == [1, 2]  # the rank's own writer wrote 3, 4 and 5
            assert [f[0] for f in run["failed"]] == [2] and "writes its memory snapshots itself" in run["failed"][0][1]
            assert run["failed"][0][1].startswith("CopyRefused: ")  # the agent's description, not wrapped again
        else:
            assert run["saved"] == [1, 2, 3, 4, 5] and run["asked"] == [1, 2, 3, 4, 5] and run["failed"] == []
            assert 3 in run["hurried"]  # it asked for the slow copy to be lifted before it waited for it
    # Step 5 copied out by the agent, and written by the rank: the same bytes; and the same final state.
    assert Path(runs[None]["file"]).read_bytes() == Path(runs[2]["file"]).read_bytes()
    assert runs[None]["state"] == runs[2]["state"]
