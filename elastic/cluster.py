"""Connecting to Ray: join the cluster we are given, or start an embedded one on loopback.

The embedded cluster is a `ray.cluster_utils.Cluster`: a head without worker
slots (it hosts the controller) and simulated nodes, each with room for
`workers_per_node` workers. Removing one of them is a real node failure:
its raylet and every worker process on it die. Nodes start on a thread of
their own (`start_node`), so that a node joining mid-run (a node fault's
`back=`) never stalls the controller, as a real node's `ray start` would not.

A simulated node's memory is its own directory under the memory tier's root
(`elastic.memory`): removing the node deletes it, as losing a machine loses
its RAM, so that what survives a node loss is what was replicated elsewhere.

A job that fits on one node and removes none runs its workers on the head
itself, as `ray.init()` on a laptop would: a second node would only add a
raylet and two agents (about 1.5% of a core on a 2-core machine, in polling
and reports) and a second or so of start-up.
"""

from __future__ import annotations

import os
import secrets
import shutil
from concurrent.futures import Future, ThreadPoolExecutor

import ray

from elastic.memory import memory_root

from elastic.sched import batch_what_starts_here

# Faster node-death detection than Ray's defaults (seconds instead of ~15 s).
FAST_FAILURE_SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 200,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}
EMBEDDED_SYSTEM_CONFIG = {
    **FAST_FAILURE_SYSTEM_CONFIG,
    # Ray starts workers at nice 15 so that they never starve its daemons. Here the workers are the
    # training ranks: at nice 15 every daemon wake-up preempts a rank, and ranks in lockstep all wait
    # for it (7-10% slower steps on 2 cores). At nice 0 they share the CPUs fairly with the daemons.
    "worker_niceness": 0,
}
"""Metrics keep Ray's default report interval (10 s): every second doubled what the node agents and
raylets took from training, and nobody can scrape an embedded cluster after its job, so the job does
not wait for a last export before the cluster goes away (`elastic.job`)."""


def _loopback_only() -> None:
    """Make this process and every Ray process it starts use 127.0.0.1 (never when joining a real cluster).

    Ray reads `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` once, when `ray` is imported:
    the variable reaches the processes the cluster starts, and the constant it
    set is corrected here for this process, which may have imported `ray`
    before (a user's script, `python -m elastic`, a test). Without both, the
    node takes the machine's outward address and Ray's GCS, agents and
    metrics exporter listen on every interface.
    """
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


def _token_auth() -> dict[str, str | None]:
    """Require a fresh random token on the embedded cluster's ports (Ray's token mode); returns the variables it replaced.

    Loopback keeps other machines out; the token keeps out other users of this
    one. The token lives in this process's environment only, which the
    cluster's processes inherit; nothing is written to `~/.ray/auth_token`.
    `RAY_AUTH_MODE=disabled` in the environment turns it off.
    """
    before = {var: os.environ.get(var) for var in _AUTH_VARS}
    if (before["RAY_AUTH_MODE"] or "").lower() == "disabled":
        return before
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _reload_auth()
    return before


def _restore_auth(before: dict[str, str | None]) -> None:
    for var, value in before.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    _reload_auth()


def _reload_auth() -> None:
    """Make this process's Ray see the auth variables as they are now (it caches the mode and the token)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


class EmbeddedCluster:
    """A multi-node Ray cluster inside this machine, on 127.0.0.1 only."""

    def __init__(self, nodes: int, cpus_per_node: float, gpus_per_node: float = 0, *, workers_on_head: bool = False, memory_dir: str = ""):
        """`nodes` simulated nodes, or with `workers_on_head` (one node's worth, `nodes` must be 1) the head alone.

        `memory_dir`: the memory tier's `checkpoint.memory_dir`, whose node directories die with their nodes.
        """
        if workers_on_head and nodes != 1:
            raise ValueError(f"workers_on_head holds one node's workers, not {nodes} nodes'")
        _loopback_only()
        self._auth_before = _token_auth()
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        from ray.cluster_utils import Cluster

        self.cpus_per_node = cpus_per_node
        self.memory_root = memory_root(memory_dir)
        self.gpus_per_node = gpus_per_node
        self.nodes = {}  # the removable nodes; the head is never one of them
        # Their daemons die with this thread (Ray's fate sharing is the kernel's parent-death signal, which follows
        # the thread that forked them): it lives until `shutdown`.
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="node-start")
        self._starting: list[Future] = []
        with batch_what_starts_here():  # Ray's daemons, the workers they fork and this driver's Ray threads (elastic.sched)
            self.cluster = Cluster(
                initialize_head=True,
                # No dashboard, autoscaler monitor or log monitor: nothing reads them here, and on a small
                # machine their polling is CPU taken from training.
                head_node_args={
                    "num_cpus": cpus_per_node if workers_on_head else 0,
                    "num_gpus": gpus_per_node if workers_on_head else 0,
                    "include_dashboard": False, "no_monitor": True, "include_log_monitor": False,
                    "_system_config": EMBEDDED_SYSTEM_CONFIG,
                },
            )
            ray.init(address=self.cluster.address, logging_level="ERROR", log_to_driver=False)
        for _ in range(0 if workers_on_head else nodes):
            self.start_node()
        self.joined(wait=True)
        self.cluster.wait_for_nodes()

    def start_node(self) -> None:
        """Start a simulated node in the background; `joined` hands out its id once it is up."""
        self._starting.append(self._starter.submit(self._new_node))

    def joined(self, wait: bool = False) -> list[str]:
        """The nodes started since the last call that are up now (with `wait`, once every one is); a start that
        failed raises here."""
        done = [f for f in self._starting if wait or f.done()]
        self._starting = [f for f in self._starting if f not in done]
        return [f.result() for f in done]

    def _new_node(self) -> str:
        """What `Cluster.add_node` does for a worker node, without its exit hooks: those register a SIGTERM handler,
        which only the main thread may. The node's daemons still die with this process (the parent-death signal),
        and `shutdown` removes them."""
        from ray._private.node import Node
        from ray._private.parameter import RayParams

        params = RayParams(
            num_cpus=self.cpus_per_node, num_gpus=self.gpus_per_node, object_store_memory=150 << 20,
            min_worker_port=0, max_worker_port=0, node_manager_port=0, include_log_monitor=False,
            redis_address=self.cluster.redis_address, gcs_address=self.cluster.gcs_address,
        )
        params.dashboard_agent_listen_port = None  # a free one: the head's agent has the default
        with batch_what_starts_here():
            node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=True)
        self.cluster.worker_nodes.add(node)
        self.cluster._wait_for_node(node)
        self.nodes[node.node_id] = node
        return node.node_id

    def remove_node(self, node_id: str) -> None:
        node = self.nodes.pop(node_id)
        self.cluster.remove_node(node, allow_graceful=True)
        shutil.rmtree(self.memory_root / node_id, ignore_errors=True)  # the node's memory goes with it

    def shutdown(self) -> None:
        ray.shutdown()
        self._starter.shutdown(wait=True)  # a node still starting is up, and in the cluster, before it goes
        self.cluster.shutdown()
        _restore_auth(self._auth_before)


def cluster_address(address: str | None) -> str | None:
    """The Ray cluster a job joins: `address`, else RAY_ADDRESS (set by `ray job submit`); None: it starts an embedded one."""
    return address or os.environ.get("RAY_ADDRESS") or None


def connect(
    address: str | None, nodes: int, cpus_per_node: float, gpus_per_node: float, *, removes_nodes: bool = False, memory_dir: str = ""
) -> EmbeddedCluster | None:
    """Join `address` (or RAY_ADDRESS, set by `ray job submit`); else start an embedded cluster.

    `removes_nodes`: the job will remove and add nodes (node faults), so even
    one node's workers need a node of their own, apart from the head.
    """
    address = cluster_address(address)
    if address:
        with batch_what_starts_here():  # this driver's Ray threads
            ray.init(address=address, logging_level="ERROR")
        return None
    return EmbeddedCluster(nodes, cpus_per_node, gpus_per_node, workers_on_head=nodes == 1 and not removes_nodes, memory_dir=memory_dir)
