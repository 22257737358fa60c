"""Faults injected into a node agent at a chosen moment of the worker group's calls: the real actor, really killed."""

import time


def kill_and_wait_dead(agent) -> None:
    """Kill an agent and return once Ray reports it dead, so the next call to it fails for certain."""
    import ray
    from ray.exceptions import RayActorError

    ray.kill(agent, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(agent.info.remote(), timeout=5)
        except RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed agent still answers")


class KilledBeforeStart:
    """An agent handle whose agent dies after it prepared its ranks, just before they are given their ranks."""

    def __init__(self, agent):
        self._agent = agent

    def __getattr__(self, name):
        if name == "start":
            kill_and_wait_dead(self._agent)
        return getattr(self._agent, name)
