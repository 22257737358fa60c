"""`ray job submit` end to end against a real Ray cluster with token authentication.

The cluster is what an operator starts by hand: a head from `ray start --head`
(no worker slots: it runs the job's driver, the controller) with the dashboard
and the job API on 127.0.0.1 and `RAY_AUTH_MODE=token`, plus two worker nodes
with four worker slots each (the job fits on one; the other holds its memory
replicas). The token comes from `ray get-auth-token --generate`
run with HOME pointing into the test's own directory, so the test neither
reads nor writes the user's `~/.ray/auth_token`.

The worker nodes are not started with `ray start --address`: on one machine that
command cannot stay on loopback. With `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` it
refuses to start a non-head node at all, and without it Ray rewrites
127.0.0.1 (the address and `--node-ip-address`) to the machine's outward
address, where the loopback-only GCS is unreachable. So the node is started the
way `ray start` starts it internally, `ray._private.node.Node(head=False)`, in a
process of its own, as `ray.cluster_utils.Cluster` does.

Everything the test starts runs in new sessions under one private temp dir, and
the finalizer stops exactly those processes (SIGTERM to the session leaders,
which take their Ray processes down with them, then SIGKILL to anything of those
sessions that is left), never `ray stop`, which would stop every Ray on the
machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

from distributed import free_ports
from elastic.metrics import scrape

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")

# A non-head Ray node on 127.0.0.1 that lives until SIGTERM (see the module docstring).
_WORKER_NODE = """
import signal, sys, time
import ray._private.parameter
from ray._private.node import Node
gcs, cpus, temp_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
agent_grpc, agent_http, metrics, runtime_env = map(int, sys.argv[4:8])
params = ray._private.parameter.RayParams(
    node_ip_address="127.0.0.1", gcs_address=gcs, num_cpus=cpus, temp_dir=temp_dir,
    metrics_agent_port=agent_grpc, dashboard_agent_listen_port=agent_http,
    metrics_export_port=metrics, runtime_env_agent_port=runtime_env,
)
node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
print("worker node up", node.unique_id, flush=True)
while not node.dead_processes():
    time.sleep(1)
sys.exit("a Ray process of the worker node died")
"""


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def _stop_sessions(procs: list[subprocess.Popen]) -> None:
    """Stop the processes we started and everything in their sessions."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.time() + 10
    for p in procs:
        while _session_pids(p.pid) and time.time() < deadline:
            time.sleep(0.5)
        for pid in _session_pids(p.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()
            p.wait()


class ClusterStartTimeout(AssertionError):
    """The cluster's processes stayed up but did not answer in time."""


class TokenCluster:
    def __init__(self, root: Path):
        self.root = root
        self.home = root / "home"
        self.home.mkdir()
        # Every port of the head in one choice: ports chosen apart can repeat (`free_ports`).
        dash, gcs, self.metrics_port, *self._head_ports = free_ports(7)
        self.dash = f"http://127.0.0.1:{dash}"
        self.gcs = f"127.0.0.1:{gcs}"
        self.procs: list[subprocess.Popen] = []
        # The environment of an operator's shell: venv first on PATH (the job's
        # entrypoint runs `elastic` from it), Ray on loopback, token auth on.
        self.env = {
            **os.environ,
            "HOME": str(self.home),
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "RAY_AUTH_MODE": "token",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            self.env.pop(var, None)

    def ray(self, *args, env=None, timeout=120, check=True) -> subprocess.CompletedProcess:
        out = subprocess.run([RAY, *args], env=env or self.env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if check and out.returncode:
            raise AssertionError(f"ray {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
        return out

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with (self.root / f"{name}.log").open("w") as log:  # the child keeps its own copy of the descriptor
            p = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root)
        self.procs.append(p)
        return p

    def start(self) -> None:
        self.ray("get-auth-token", "--generate")
        self.token = (self.home / ".ray" / "auth_token").read_text().strip()
        temp_dir = str(self.root / "ray")
        client, agent_grpc, agent_listen, runtime_env = self._head_ports
        # Every port is chosen up front: other clusters on this machine hold Ray's
        # default ports, and a raylet told its agents' ports does not wait for the
        # agents to publish them (on a loaded machine that wait times out after
        # about 15 s and the node aborts).
        self._spawn("head", [
            RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={self.gcs.split(':')[1]}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dash.rsplit(':', 1)[1]}",
            f"--ray-client-server-port={client}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--dashboard-agent-listen-port={agent_listen}", f"--metrics-export-port={self.metrics_port}",
            f"--runtime-env-agent-port={runtime_env}",
            "--num-cpus=0", f"--temp-dir={temp_dir}", "--disable-usage-stats",
        ])
        self._wait(lambda: self._get("/api/version") is not None, "the dashboard to answer")
        for n in (1, 2):  # one after the other: a node starting finds itself in the GCS by its sockets' directory
            self._spawn(f"worker-{n}", [sys.executable, "-c", _WORKER_NODE, self.gcs, "4", temp_dir, *map(str, free_ports(4))])
            self._wait(lambda: len(self.alive_nodes()) == 1 + n, f"{1 + n} alive nodes")

    def stop(self) -> None:
        _stop_sessions(self.procs)
        shutil.rmtree(self.root, ignore_errors=True)

    def _get(self, path: str, token: str | None = "own"):
        headers = {"Authorization": f"Bearer {self.token if token == 'own' else token}"} if token else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.dash + path, headers=headers), timeout=5) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None

    def alive_nodes(self) -> list[dict]:
        body = self._get("/api/v0/nodes?detail=1")
        if not isinstance(body, dict):
            return []
        return [n for n in body["data"]["result"]["result"] if n["state"] == "ALIVE"]

    def _wait(self, ready, what: str, timeout: float = 90) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"a cluster process exited while waiting for {what}:\n{self._logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise ClusterStartTimeout(f"timed out waiting for {what}:\n{self._logs()}")

    def _logs(self) -> str:
        """The tails of the processes' own logs and of Ray's dashboard and GCS logs: why a start hung or failed."""
        ray_logs = self.root / "ray" / "session_latest" / "logs"
        files = [*self.root.glob("*.log"), *(ray_logs / name for name in ("dashboard.log", "gcs_server.out"))]
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in files if f.is_file())


def _start_cluster(attempts: int = 2) -> TokenCluster:
    """A started cluster. A start whose processes stay up but never answer is stopped and made again on fresh
    ports and a fresh root, with a warning that carries its logs: in one suite run a head's dashboard did not
    answer in 90 s, a start that takes seconds alone. A process that exits, or a second timeout, fails."""
    for attempt in range(1, attempts + 1):
        # A short root: Ray's Unix socket paths live under it and must stay under 108 bytes.
        cluster = TokenCluster(Path(tempfile.mkdtemp(prefix="elx-", dir="/tmp")))
        try:
            cluster.start()
            return cluster
        except BaseException as exc:
            cluster.stop()
            if attempt == attempts or not isinstance(exc, ClusterStartTimeout):
                raise
            warnings.warn(f"ray start attempt {attempt} timed out; starting again on fresh ports. {exc}")


@pytest.fixture(scope="module")
def token_cluster():
    cluster = _start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_cluster_is_loopback_only_and_needs_the_token(token_cluster):
    nodes = token_cluster.alive_nodes()
    assert {n["node_ip"] for n in nodes} == {"127.0.0.1"}
    assert sorted(n["is_head_node"] for n in nodes) == [False, False, True]
    # The job API refuses a request without a token (401) and with a wrong one (403).
    assert token_cluster._get("/api/jobs/", token=None) == 401
    assert token_cluster._get("/api/jobs/", token="0" * 64) == 403
    assert isinstance(token_cluster._get("/api/jobs/"), list)
    # The Prometheus endpoint is not behind the token (Prometheus scrapes it as is):
    # it must stay on a private address too.
    assert scrape(f"http://127.0.0.1:{token_cluster.metrics_port}/metrics")


def test_submit_without_token_is_refused(token_cluster, tmp_path):
    marker = tmp_path / "ran"
    for name, env in {
        "no token": {**token_cluster.env, "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"},
        "wrong token": {**token_cluster.env, "HOME": str(tmp_path), "RAY_AUTH_TOKEN": "0" * 64},
    }.items():
        out = token_cluster.ray(
            "job", "submit", "--no-wait", "--address", token_cluster.dash, "--", "touch", str(marker), env=env, check=False
        )
        assert out.returncode != 0, name
        assert "Authentication required" in out.stderr + out.stdout or "Invalid authentication token" in out.stderr + out.stdout, (name, out.stderr[-2000:])
    assert token_cluster._get("/api/jobs/") == []
    assert not marker.exists()


def test_ray_job_submit_runs_elastic_end_to_end(token_cluster, tmp_path):
    run_root = tmp_path / "runs"
    sub_id = "elastic-submit-test"
    sets = {
        "run_root": run_root,
        "checkpoint.uri": tmp_path / "ckpt",
        "training.steps": 70,
        "checkpoint.every_steps": 20,
        "fault.inject": '["kill:rank=1,step=55"]',
    }
    entrypoint = ["elastic", "run", "deploy/examples/demo.yaml", "--fresh"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    token_cluster.ray("job", "submit", "--no-wait", "--address", token_cluster.dash, "--submission-id", sub_id, "--working-dir", ".", "--", *entrypoint)
    logs = token_cluster.ray("job", "logs", "--follow", "--address", token_cluster.dash, sub_id, timeout=300).stdout
    status = token_cluster.ray("job", "status", "--address", token_cluster.dash, sub_id)
    assert f"Job '{sub_id}' succeeded" in status.stdout + status.stderr
    assert token_cluster._get(f"/api/jobs/{sub_id}")["status"] == "SUCCEEDED", logs[-4000:]

    # The progress printer writes plain lines when not on a terminal: they read well in `ray job logs`.
    assert "step    70/70" in logs and "[failure] rank_died rank 1" in logs, logs[-4000:]
    report = json.loads((run_root / "demo" / "report.json").read_text())
    assert report["state"] == "FINISHED" and report["steps_completed"] == 70
    assert report["world_sizes"] == [4, 4]
    (failure,) = report["failures"]
    assert failure["kind"] == "kill" and failure["rank"] == 1
    assert failure["restored_from"] == "memory" and failure["lost_steps"] <= 1, failure
    # The four ranks fit on one worker node: the first generation starts without a node for their replicas (and
    # says so). The other gets an agent once the job's first step asks it for a warm spare; from then on it holds
    # the memory replicas of the ranks' node, mid-generation (on a GPU cluster, a job on one node of eight GPUs),
    # and keeps them: it joins the ring once and never leaves it. On very busy cores that agent can take longer to
    # start than the first generation lasts; the second generation then starts with it in the ring.
    events = [json.loads(line) for line in (run_root / "demo" / "events.jsonl").read_text().splitlines()]
    rings = [e for e in events if e["event"] == "replica_ring"]
    assert [(e["generation"], len(e["ring"])) for e in rings] in ([(1, 1), (1, 2)], [(1, 1)]), rings
    commits = [e["replicated"] for e in events if e["event"] == "memory_committed"]
    assert True in commits and all(commits[commits.index(True):]), commits
    assert not [e for e in events if e["event"] == "warning"], "a warning in a run without trouble"
    assert report["samples"]["missing"] == 0 and report["samples"]["duplicated"] == 0
