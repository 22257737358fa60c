"""The node agent (elastic.agent) and the worker group's calls to it, on a one-node embedded Ray.

Rank processes are plain processes that go when their agent goes; the
agent's state survives concurrent calls; a late answer from a rank is never
taken for the next command's; and a call to an agent that died fails as a
`StartError` or `RanksUnreachable`, never as a raw Ray error.
"""

import contextlib
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest

from elastic import rank_process, zygote

pytestmark = pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pids, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return all(_gone(pid) for pid in pids)


def _stat(pid) -> tuple[str, str, int]:
    """(comm, state, parent pid) of a process."""
    text = Path(f"/proc/{pid}/stat").read_text()
    comm, rest = text[text.index("(") + 1 : text.rindex(")")], text.rsplit(")", 1)[1].split()
    return comm, rest[0], int(rest[1])


def _processes() -> dict[int, tuple[str, str, int]]:
    """{pid: (comm, state, parent pid)} of every process."""
    stats = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stats[int(entry.name)] = _stat(entry.name)
        except OSError:
            continue
    return stats


def _children_of(pid: int) -> dict[int, str]:
    """{pid: state} of every child of `pid`, zombies too."""
    return {child: state for child, (_, state, ppid) in _processes().items() if ppid == pid}


def _rank_processes_of(agent: int) -> list[int]:
    """The live rank processes an agent started: its children named as ranks, and every child of its fork server
    (`elastic.zygote`), which forks nothing else; a fork may not have renamed itself yet (a spare is not waited for)."""
    stats = _processes()
    zygotes = {pid for pid, (comm, _, ppid) in stats.items() if ppid == agent and comm == zygote.PROCESS_NAME}
    return [pid for pid, (comm, state, ppid) in stats.items()
            if state != "Z" and (ppid in zygotes or (ppid == agent and comm == rank_process.PROCESS_NAME))]


RAY_CLEANUP_OFF = {"RAY_kill_child_processes_on_worker_exit": "0", "RAY_process_group_cleanup_enabled": "0"}
"""Ray's raylet kills a dead worker's children on its own; with that off, these tests see what the agent and
its ranks guarantee by themselves (the raylet can die with its node, and a job may run where it is disabled)."""


@pytest.fixture(scope="module")
def ray_node():
    """One node with two worker slots on the head; each test kills the agents it makes, freeing the slots."""
    from elastic.cluster import EmbeddedCluster

    saved = {k: os.environ.get(k) for k in RAY_CLEANUP_OFF}
    os.environ.update(RAY_CLEANUP_OFF)  # read by the raylet when it starts
    try:
        cluster = EmbeddedCluster(1, 2, workers_on_head=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    yield cluster
    cluster.shutdown()


@pytest.fixture
def store():
    """A rendezvous store that the stuck ranks below wait in."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def _stuck_specs(n: int, generation: int = 1) -> list[dict]:
    """Specs for `n` ranks of a world of n+1: their training threads wait in the rendezvous for a rank that never comes."""
    layout = {"pp": 1, "dp_replicate": 1, "dp_shard": n + 1, "tp": 1}
    return [{"config": {}, "layout": layout, "rank": r, "generation": generation} for r in range(n)]


def _agent(slots: int = 2):
    import ray

    from elastic.agent import NodeAgent

    agent = NodeAgent.options(num_cpus=slots).remote(1.0, 0.0)
    return agent, ray.get(agent.info.remote())["pid"]


def _kill_and_reap(agent, pids) -> None:
    import ray

    ray.kill(agent, no_restart=True)
    _wait_gone(pids, 10)
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_rank_processes_run_no_ray_code_and_die_with_their_agent(ray_node):
    import ray

    agent, agent_pid = _agent()
    pids = ray.get(agent.prepare.remote(2, 0, 120.0))
    try:
        assert len(set(pids)) == 2 and sorted(_rank_processes_of(agent_pid)) == sorted(pids)
        for pid in pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "_raylet" not in maps, "a rank process loaded Ray's core worker"
        # Asked again, the agent reuses its warm processes.
        assert sorted(ray.get(agent.prepare.remote(2, 0, 120.0))) == sorted(pids)
        ray.kill(agent, no_restart=True)
        assert _wait_gone(pids, 10), "rank processes outlived their agent"
    finally:
        _kill_and_reap(agent, pids)


def _zygote_of(agent: int) -> int | None:
    """The agent's live fork server (`elastic.zygote`), if it has one."""
    return next((pid for pid, (comm, state, ppid) in _processes().items()
                 if ppid == agent and comm == zygote.PROCESS_NAME and state != "Z"), None)


def test_a_dead_fork_server_is_started_again_for_the_next_ranks(ray_node):
    import ray

    agent, agent_pid = _agent()
    pids = ray.get(agent.prepare.remote(1, 0, 120.0))
    try:
        first = _zygote_of(agent_pid)
        assert first is not None and _stat(pids[0])[2] == first
        os.kill(first, signal.SIGKILL)
        assert _wait_gone(pids, 10), "a forked rank outlived its fork server"
        # The next ranks are forked again, from a new fork server: not each started afresh at a cold start's cost.
        deadline, dead = time.monotonic() + 10, pids
        while pids == dead and time.monotonic() < deadline:  # until the agent has seen its rank's end
            pids = ray.get(agent.prepare.remote(1, 0, 120.0))
        second = _zygote_of(agent_pid)
        assert second not in (None, first) and _stat(pids[0])[2] == second
    finally:
        _kill_and_reap(agent, pids)


def test_rank_whose_main_thread_is_busy_dies_with_its_agent(ray_node, store):
    # The rank's main thread is in a long `reset` (joining a training thread stuck in the rendezvous), so it
    # reads no pipe EOF: only the parent-death signal ends it when the agent is SIGKILLed.
    import ray

    agent, agent_pid = _agent()
    pids = ray.get(agent.prepare.remote(1, 0, 120.0))
    try:
        ray.get(agent.start.remote([(0, _stuck_specs(1)[0])], "127.0.0.1", store.port, 60.0))
        agent.teardown.remote([], 60.0)  # not waited for: the rank now waits up to 60 s for its loop
        time.sleep(0.5)
        os.kill(agent_pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert _wait_gone(pids, 3), "a rank outlived its SIGKILLed agent"
        assert time.monotonic() - t0 < 1.5
    finally:
        _kill_and_reap(agent, pids)


def test_late_stacks_answer_is_not_taken_for_the_next_command(ray_node, store):
    # A dump that misses its deadline answers later; the reset that follows must get its own answer
    # (False: the loop is stuck), not the late dump, or a stuck process would be kept warm.
    import ray

    agent, _ = _agent()
    pids = ray.get(agent.prepare.remote(1, 0, 120.0))
    try:
        ray.get(agent.start.remote([(0, _stuck_specs(1)[0])], "127.0.0.1", store.port, 60.0))
        ray.get(agent.stacks.remote(0.0))  # no answer within 0 s: it arrives just after
        time.sleep(0.3)
        assert ray.get(agent.teardown.remote([], 0.3)) == 0, "a stuck rank was kept warm"
        assert _wait_gone(pids, 5)
    finally:
        _kill_and_reap(agent, pids)


def test_stacks_carry_the_training_thread_apart(ray_node, store):
    import ray

    agent, _ = _agent()
    pids = ray.get(agent.prepare.remote(1, 0, 120.0))
    try:
        ray.get(agent.start.remote([(0, _stuck_specs(1)[0])], "127.0.0.1", store.port, 60.0))
        time.sleep(0.3)
        (dump,) = ray.get(agent.stacks.remote(5.0)).values()
        assert "init_process_group" in dump.training  # where the training thread waits
        assert "init_process_group" not in dump.others and "reporter" in dump.others
        assert dump.text().startswith("--- training thread")
    finally:
        _kill_and_reap(agent, pids)


def test_concurrent_spare_calls_start_one_process(ray_node):
    import ray

    agent, agent_pid = _agent()
    try:
        ray.get([agent.spare.remote() for _ in range(8)])  # the actor runs them on up to 8 threads at once
        assert len(_rank_processes_of(agent_pid)) == 1
    finally:
        _kill_and_reap(agent, _rank_processes_of(agent_pid))


def _agent_with_a_slow_fork_server(tmp_path, sleep_s: float):
    """An agent whose fork server sleeps `sleep_s` before it starts (a node busy importing torch); (agent, its pid)."""
    import ray

    from elastic.agent import NodeAgent

    (tmp_path / "sitecustomize.py").write_text(
        f"import sys, time\nif 'elastic.zygote' in sys.orig_argv:\n    time.sleep({sleep_s})\n")
    agent = NodeAgent.options(num_cpus=1, runtime_env={"env_vars": {"PYTHONPATH": str(tmp_path)}}).remote(1.0, 0.0)
    return agent, ray.get(agent.info.remote())["pid"]


def test_a_poll_answers_while_a_spare_waits_for_a_slow_fork_server(ray_node, tmp_path):
    # A node that holds a job's memory replicas gets its first warm spare while the job trains, and its fork server
    # can take seconds to start (importing torch on busy cores). The controller drops a replica host whose poll goes
    # unanswered for REPLICA_HOST_TIMEOUT_S: a poll must not wait for a spawn. Here the fork server sleeps 6 s first.
    import ray

    agent, agent_pid = _agent_with_a_slow_fork_server(tmp_path, 6)
    try:
        spare = agent.spare.remote()
        time.sleep(1.0)  # the spare is now waiting for the fork server
        assert ray.get(agent.poll.remote(1, 0.0), timeout=60) == []
        assert not ray.wait([spare], timeout=0)[0], "the poll waited for the spare's fork server"
        ray.get(spare, timeout=120)
        assert len(_rank_processes_of(agent_pid)) == 1
    finally:
        _kill_and_reap(agent, _rank_processes_of(agent_pid))


def test_shutdown_while_a_spare_waits_for_the_fork_server_leaves_no_process(ray_node, tmp_path):
    # The worker group shuts an agent down when its node leaves the job, and a spare may then be starting (the fork
    # server takes seconds on busy cores). What that spawn starts must not outlive the shutdown, even while the agent
    # process lives on. Here the fork server sleeps 4 s first.
    import ray

    agent, agent_pid = _agent_with_a_slow_fork_server(tmp_path, 4)
    try:
        spare = agent.spare.remote()
        time.sleep(1.0)  # the spare is now waiting for the fork server
        ray.get(agent.shutdown.remote(), timeout=60)
        with pytest.raises(ray.exceptions.RayTaskError, match="shutting down"):
            ray.get(spare, timeout=120)
        assert _children_of(agent_pid) == {}, "the shutdown left the spare's rank process or the fork server running, or unreaped"
        assert ray.get(agent.info.remote())["pid"] == agent_pid  # the agent itself is still up
    finally:
        _kill_and_reap(agent, _rank_processes_of(agent_pid))


def test_shutdown_while_a_spawn_waits_on_a_fork_leaves_no_zombie(ray_node):
    # The spawn's other race with shutdown: the fork server has started and a fork is under way when shutdown kills
    # the fork server. The spawn then starts a fresh process, finds the agent shut down and kills it: it must reap it
    # too, or a zombie lives in the agent. The fork server is stopped (SIGSTOP) so that the fork waits on it.
    import ray

    agent, agent_pid = _agent(1)
    try:
        ray.get(agent.spare.remote(), timeout=120)  # the fork server is up; one idle spare
        (first,) = _rank_processes_of(agent_pid)
        fork_server = _stat(first)[2]
        os.kill(first, signal.SIGKILL)  # so that the next spare call starts another
        assert _wait_gone([first], 30)
        time.sleep(0.5)  # the agent hears of its end
        os.kill(fork_server, signal.SIGSTOP)
        spare = agent.spare.remote()
        time.sleep(1.0)  # the spare's fork now waits on the stopped fork server
        ray.get(agent.shutdown.remote(), timeout=60)
        with pytest.raises(ray.exceptions.RayTaskError, match="shutting down"):
            ray.get(spare, timeout=60)
        assert _children_of(agent_pid) == {}, "the shutdown left a process of the agent's, running or unreaped"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(fork_server, signal.SIGCONT)
        _kill_and_reap(agent, _rank_processes_of(agent_pid))


# -- the worker group ----------------------------------------------------------------------


def _group(store, group_class=None):
    from elastic.config import load_config
    from elastic.worker_group import RayWorkerGroup

    sets = {"scaling.num_workers": 2, "scaling.min_workers": 1, "scaling.workers_per_node": 2, "fault.inject": "[]",
            "fault.startup_timeout_s": 120}
    cfg = load_config("deploy/examples/demo.yaml", [f"{k}={v}" for k, v in sets.items()])
    return (group_class or RayWorkerGroup)(cfg, "127.0.0.1", store.port)


def test_agent_lost_between_prepare_and_start_is_a_start_error(ray_node, store):
    from agent_faults import KilledBeforeStart
    from elastic.layout import Layout
    from elastic.worker_group import RayWorkerGroup, StartError

    class Group(RayWorkerGroup):
        def _agent(self, node_id, slots):
            return KilledBeforeStart(super()._agent(node_id, slots))

    group = _group(store, Group)
    try:
        with pytest.raises(StartError, match="given their ranks.*ActorDiedError"):
            group.start(Layout(dp_shard=2), _stuck_specs(2))
    finally:
        group.shutdown()


def test_a_job_on_one_node_takes_a_replica_host_mid_generation_and_drops_it_once_its_agent_dies(ray_node, store, tmp_path):
    # A job whose ranks are all on one node keeps its memory replicas on another node. When it starts, no other node
    # may have an agent of the job yet (the job's first start, a node that joins later); as soon as one has (a warm
    # spare's), the group makes that node the ring's host, mid-generation: the ranks' node is told to replicate
    # there. The host is not polled: the group sends it the memory floor about once a second, and drops it from the
    # ring when that call fails. (This cluster has one node: an agent made here stands in for another node's, and
    # Ray's list of live nodes gets an entry for it.)
    import ray

    from agent_faults import kill_and_wait_dead
    from elastic.agent import NodeAgent
    from elastic.layout import Layout
    from elastic.worker_group import LONG_POLL_S, RayWorkerGroup

    class Group(RayWorkerGroup):
        extra_nodes: list[dict] = []

        def _alive(self):
            return super()._alive() + self.extra_nodes

    def peer_of(agent, want):
        deadline = time.monotonic() + 10  # set_peer is not waited for
        while (got := ray.get(agent.peer_address.remote())) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def poll_until(ring):
        deadline = time.monotonic() + 4 * LONG_POLL_S
        while group.replica_ring != ring and time.monotonic() < deadline:
            group.poll(0.2)
        return group.replica_ring

    group = _group(store, Group)
    try:
        group.start(Layout(dp_shard=2), _stuck_specs(2))
        (node,) = group.agents
        assert group.replica_ring == [node] and peer_of(group.agents[node], None) is None  # no other agent: no replicas
        (alone,) = group.ring_changes()  # said at the start, for the console and the event log
        assert alone["ring"] == [node] and f"the ranks are all on node {node[:8]} and no other node of the job is up" in alone["reason"]
        memory = {"dir": str(tmp_path), "job": group.memory_job, "replicas": 1, "secret": group.replica_secret}
        host = NodeAgent.options(num_cpus=0).remote(1.0, 0.0, "", memory, True)
        group.agents["host"] = host
        group.poll(0.1)
        time.sleep(LONG_POLL_S)
        group.poll(0.1)
        assert group.replica_ring == [node], "a node Ray does not list as up is never the host"
        Group.extra_nodes = [{"NodeID": "host", "Alive": True, "Resources": {"CPU": 2.0}}]
        assert poll_until([node, "host"]) == [node, "host"]
        address = ray.get(host.replica_address.remote())
        assert peer_of(group.agents[node], address) == address and group.replica_holder(node) == "host"
        assert group.ring_changes() == [{"generation": 1, "ring": [node, "host"], "reason": "node host holds the replicas from the next snapshot on"}]
        assert ray.get(host.memory_inventory.remote()) == {}  # polled with the floor: it answers
        kill_and_wait_dead(host)
        assert poll_until([node]) == [node]
        assert peer_of(group.agents[node], None) is None and group.replica_holder(node) is None
        (dropped,) = group.ring_changes()
        assert dropped["ring"] == [node] and "node host holding the replicas did not answer" in dropped["reason"]
    finally:
        Group.extra_nodes = []
        group.shutdown()


def test_the_memory_files_an_agent_killed_at_teardown_leaves_on_a_node_that_is_up_go_at_the_end_of_the_job(ray_node, store):
    # An agent that dies, or cannot end its generation in time, is killed at teardown: its node's memory files stay
    # in that node's RAM (an agent that shuts down removes its own). At the end of the job the group removes them
    # on each such node that is up and has no agent of the job.
    from agent_faults import kill_and_wait_dead
    from elastic.layout import Layout
    from elastic.memory import memory_root

    group = _group(store)
    try:
        group.start(Layout(dp_shard=2), _stuck_specs(2))
        (node,) = group.agents
        files = memory_root(group.cfg.checkpoint.memory_dir) / node / group.memory_job
        (files / "step_00000003" / "data").mkdir(parents=True, exist_ok=True)
        (files / "step_00000003" / "data" / "g000001-rank_00000.bin").write_bytes(b"x" * 4096)  # a snapshot's file
        kill_and_wait_dead(group.agents[node])
        group.teardown(kill_ranks=[0, 1])
        assert node not in group.agents and files.is_dir()
    finally:
        group.shutdown()
    assert not files.exists()


def test_calls_to_a_dead_agent_fail_as_unreachable_ranks_not_ray_errors(ray_node, store):
    import ray

    from agent_faults import kill_and_wait_dead
    from elastic.layout import Layout
    from elastic.worker_group import SPARE_TIMEOUT_S, RanksUnreachable

    group = _group(store)
    try:
        group.start(Layout(dp_shard=2), _stuck_specs(2))
        (agent,) = group.agents.values()
        agent_pid = ray.get(agent.info.remote())["pid"]
        group.replenish()
        assert group.spare_errors(wait_s=SPARE_TIMEOUT_S) == {}  # the spare is there once its fork is
        assert len(_rank_processes_of(agent_pid)) == 3
        kill_and_wait_dead(agent)
        with pytest.raises(RanksUnreachable) as lost:
            group.stop_after(5)
        assert lost.value.ranks == [0, 1]
        group.replenish()
        (error,) = group.spare_errors(wait_s=SPARE_TIMEOUT_S).values()  # reported, not lost
        assert "died" in error.lower() or "dead" in error.lower()
        assert [s.alive for s in group.poll(1.0)] == [False, False]
        assert group.teardown() == 0 and not group.agents
    finally:
        group.shutdown()
