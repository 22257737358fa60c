"""Nothing a job starts listens beyond loopback, however it is started; the embedded Ray needs a token; store values are untrusted.

Each guarantee that depends on the environment or on import order is checked
in a fresh subprocess with a clean environment (no RAY_* variables, `ray`
imported before elastic), the way a user's shell or script would start it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from listening import beyond_loopback, descendants, listening
from test_controller_steps import ScriptedGroup, _run

from elastic.config import load_config
from elastic.controller import Controller, State
from elastic.events import EventLog
from elastic.faults import parse_faults
from elastic.rank_process import PROCESS_NAME
from elastic.rendezvous import open_store

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TESTS = Path(__file__).resolve().parent


def _clean_env(tmp_path: Path) -> dict[str, str]:
    """What a plain login shell has: no RAY_* or ELASTIC settings, a HOME of its own."""
    return {"PATH": f"{BIN}{os.pathsep}/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}


def test_store_listens_on_the_given_address_only():
    store = open_store("127.0.0.1")
    mine = [(ip, port) for _, ip, port in listening({os.getpid()}) if port == store.port]
    assert mine == [("127.0.0.1", store.port)]
    store.set("k", "v")
    assert store.get("k") == b"v"


_CLUSTER_SCRIPT = """
import os, subprocess, sys, time
import ray  # first, as a user's script may: Ray reads its loopback switch at import
sys.path.insert(0, {tests!r})
from listening import beyond_loopback, descendants, listening
from elastic.cluster import connect

cluster = connect(None, 2, 1, 0)
try:
    time.sleep(1.0)
    pids = descendants(os.getpid())
    print("LISTENING", len(listening(pids)), "BEYOND", beyond_loopback(pids), flush=True)
    probe = "import ray; ray.init(address={{!r}}); print('JOINED')".format(cluster.cluster.address)
    for name, token in (("none", None), ("wrong", "0" * 64)):
        env = {{k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}}
        if token:
            env["RAY_AUTH_TOKEN"] = token
        r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        print("CLIENT", name, "JOINED" in r.stdout, flush=True)
finally:
    cluster.shutdown()
"""


def test_embedded_cluster_is_loopback_only_and_needs_its_token(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _CLUSTER_SCRIPT.format(tests=str(TESTS))], env=_clean_env(tmp_path), cwd=REPO,
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.split()}
    listening_line = lines["LISTENING"].split()
    assert int(listening_line[1]) >= 5, out.stdout  # Ray's GCS, raylets, agents: there is something to check
    assert lines["LISTENING"].endswith("BEYOND []"), out.stdout
    assert "CLIENT none False" in out.stdout and "CLIENT wrong False" in out.stdout, out.stdout + out.stderr[-2000:]


def test_elastic_run_typed_in_a_plain_shell_listens_on_loopback_only(tmp_path):
    """`elastic run` from a clean environment: every socket of the job's process tree, sampled through the run."""
    argv = [
        str(BIN / "elastic"), "run", "deploy/examples/demo.yaml", "--quiet",
        "--set", "name=loopback", "--set", f"run_root={tmp_path / 'runs'}", "--set", "fault.inject=[]",
        "--set", "scaling.num_workers=2", "--set", "scaling.workers_per_node=1", "--set", "training.steps=40",
        "--set", "checkpoint.every_steps=20",
    ]
    proc = subprocess.Popen(argv, env=_clean_env(tmp_path), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, exposed, rank_envs = 0, [], {}
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            pids = descendants(proc.pid)
            seen = max(seen, len(listening(pids)))
            exposed += beyond_loopback(pids)
            rank_envs |= _rank_environments(pids)
            time.sleep(0.5)
        output = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert seen >= 5, f"only {seen} listening sockets seen: the sampling missed the job"
    assert not exposed, f"listening beyond loopback: {sorted(set(exposed))}"
    # gloo would bind to whatever the host name resolves to (here 127.0.0.1, on a cloud VM its outward address):
    # the ranks of an embedded cluster are pinned to the loopback interface whatever this machine's names are.
    assert rank_envs and all(env.get("GLOO_SOCKET_IFNAME") == env.get("NCCL_SOCKET_IFNAME") == "lo" for env in rank_envs.values())


def _rank_environments(pids: set[int]) -> dict[int, dict[str, str]]:
    """The environment of each rank process among `pids`."""
    out = {}
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != PROCESS_NAME:
                continue
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        out[pid] = dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)
    return out


def test_garbage_in_the_store_is_an_event_not_a_crash(tmp_path):
    cfg = load_config("deploy/examples/demo.yaml", [
        "training.steps=12", "checkpoint.every_steps=4", "training.global_batch=8", "fault.heartbeat_s=0.001",
        f"checkpoint.uri={tmp_path / 'ckpt'}", f"run_root={tmp_path}", "fault.inject=[]",
    ])
    store = open_store("127.0.0.1")
    faults = parse_faults(["kill:rank=1,step=50"])  # never fires by itself: only the store speaks for it
    ctrl = Controller(cfg, ScriptedGroup(cfg, 4), EventLog(tmp_path / "events.jsonl"), faults=faults, fault_store=store)
    ctrl.step()
    for garbage in (b"not json", b"[1, 2]", json.dumps({"t": "soon", "step": 3}).encode(), b'{"t": 1e999, "step": 3}', b"\xff\xfe"):
        store.set("fault/0", garbage)
        assert ctrl.step() is State.RUNNING
    warnings = [e for e in ctrl.events.of("warning") if e["kind"] == "bad_store_value"]
    assert len(warnings) == 5 and all(w["key"] == "fault/0" for w in warnings)
    assert not ctrl.events.of("fault_injected")
    store.set("fault/0", json.dumps({"t": time.time(), "step": 3}))
    ctrl.step()
    assert [e["fault_id"] for e in ctrl.events.of("fault_injected")] == [0]
    assert _run(ctrl)[-1] is State.FINISHED


def test_a_job_closes_what_it_opens(tmp_path):
    """The driver's store (its socket and server thread) and the job's own threads are gone when run_job returns."""
    import threading

    from elastic.job import run_job

    cfg = load_config("deploy/examples/demo.yaml", [
        "name=closes", f"run_root={tmp_path}", "fault.inject=[]", "scaling.num_workers=1", "scaling.min_workers=1",
        "training.steps=3", "checkpoint.every_steps=3",
    ])
    def comm(tid: str) -> str:
        try:
            return open(f"/proc/self/task/{tid}/comm").read().strip()
        except FileNotFoundError:
            return ""  # the thread ended after the listing

    def store_threads() -> int:
        return sum(comm(t) == "pt_tcpstore" for t in os.listdir("/proc/self/task"))

    sockets_before = {(ip, port) for _, ip, port in listening({os.getpid()})}
    threads_before = threading.enumerate()  # objects, not ids: an ended thread's id may be reused
    store_threads_before = store_threads()  # other tests' stores may still await the garbage collector
    report = run_job(cfg, quiet=True)
    assert report["state"] == "FINISHED"
    left = {(ip, port) for _, ip, port in listening({os.getpid()})} - sockets_before
    assert not left, f"still listening after the job: {left}"
    assert not [t.name for t in threading.enumerate() if t not in threads_before]
    assert store_threads() == store_threads_before
