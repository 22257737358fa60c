"""The node agent (elastic.agent): its ranks are plain processes, and they go when the agent goes."""

import os
import time
from pathlib import Path

import pytest


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
def test_rank_processes_run_no_ray_code_and_die_with_their_agent():
    import ray

    from elastic.agent import NodeAgent
    from elastic.cluster import EmbeddedCluster

    cluster = EmbeddedCluster(1, 2, workers_on_head=True)
    pids: list[int] = []
    try:
        agent = NodeAgent.options(num_cpus=2).remote(1.0, 0.0)
        agent_pid = ray.get(agent.info.remote())["pid"]
        pids += ray.get(agent.prepare.remote(2, 0, 120.0))
        assert len(set(pids)) == 2
        for pid in pids:
            assert "elastic.rank_process" in Path(f"/proc/{pid}/cmdline").read_text()
            assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == agent_pid
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "_raylet" not in maps, "a rank process loaded Ray's core worker"
        # Asked again, the agent reuses its warm processes.
        assert sorted(ray.get(agent.prepare.remote(2, 0, 120.0))) == sorted(pids)
        ray.kill(agent, no_restart=True)
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in pids), "rank processes outlived their agent"
    finally:
        cluster.shutdown()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, 9)
