"""Where the CPU goes while a benchmark runs, sampled from /proc (Linux).

On a machine whose speed drifts by more than the effect being measured, a
step-time ratio alone cannot say whether the manager costs 2% or 8%. CPU
accounting can: `CpuSampler` snapshots, once a second, the CPU time of every
process in this process's tree (thread by thread in the rank processes) and of
the whole machine, and `window(t0, t1)` turns two snapshots into cores used
by each class:

- `training`: each rank process's busiest thread (the training loop) and its
  gloo threads, i.e. the work both launchers must do;
- `rank_other`: every other thread of the rank processes (under the
  manager: the command and reporter threads) and rank processes that did
  not train (a warm spare);
- `launcher`: this process (the controller, or the plain launcher waiting on
  its children, and the sampler itself) and the rest of its tree (Ray's GCS,
  raylet and agents, and the node agents that run the ranks);
- `machine_other`: everything else on the machine (other users, the kernel);
- `idle`: cores nobody used.

Rank processes are the tree's processes named `elastic-rank` (manager: started
afresh or forked by a node's fork server) and `multiprocessing` spawn children
(plain). Reading /proc costs the sampler a
few milliseconds a second, on both sides alike.
"""

from __future__ import annotations

import os
import threading
import time

from elastic.rank_process import PROCESS_NAME

HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")
CLASSES = ("training", "rank_other", "launcher", "machine_other", "idle")


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def _stat(path: str) -> tuple[str, int, float] | None:
    """(comm, ppid, cpu seconds) from a /proc stat file."""
    text = _read(path)
    if text is None:
        return None
    close = text.rindex(")")
    fields = text[close + 2 :].split()
    return text[text.index("(") + 1 : close], int(fields[1]), (int(fields[11]) + int(fields[12])) / HZ


def _is_rank(pid: int, comm: str) -> bool:
    return comm == PROCESS_NAME or "multiprocessing.spawn" in (_read(f"/proc/{pid}/cmdline") or "")


def snapshot(root: int) -> dict:
    """CPU seconds so far: the machine (busy, idle), `root`'s tree by process, and the rank processes by thread."""
    cpu = (_read("/proc/stat") or "cpu 0 0 0 0").splitlines()[0].split()[1:]
    ticks = [int(x) for x in cpu[:8]]
    procs: dict[int, tuple[str, int, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(f"/proc/{name}/stat")) is not None:
            procs[int(name)] = st
    tree, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            tree.add(child)
            frontier.append(child)
    ranks: dict[int, dict[int, tuple[str, float]]] = {}
    for pid in tree:
        if pid in procs and _is_rank(pid, procs[pid][0]):
            threads = {}
            for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
                if (st := _stat(f"/proc/{pid}/task/{tid}/stat")) is not None:
                    threads[int(tid)] = (st[0], st[2])
            ranks[pid] = threads
    return {
        "t": time.time(),
        "busy_s": (sum(ticks) - ticks[3] - ticks[4]) / HZ,
        "idle_s": (ticks[3] + ticks[4]) / HZ,
        "tree": {pid: procs[pid][2] for pid in tree if pid in procs},
        "ranks": ranks,
    }


def classify(a: dict, b: dict) -> dict[str, float]:
    """Cores used by each class (`CLASSES`) between snapshots `a` and `b`."""
    dt = b["t"] - a["t"]
    used = dict.fromkeys(CLASSES, 0.0)
    for pid, threads in b["ranks"].items():
        before = a["ranks"].get(pid, {})
        deltas = {tid: (comm, cpu - before.get(tid, (comm, 0.0))[1]) for tid, (comm, cpu) in threads.items()}
        busiest = max(deltas, key=lambda tid: deltas[tid][1], default=None)
        trained = busiest is not None and deltas[busiest][1] > 0.05 * dt  # a warm spare does not train
        for tid, (comm, d) in deltas.items():
            training = trained and (tid == busiest or comm in GLOO_THREADS)
            used["training" if training else "rank_other"] += d
    tree = sum(cpu - a["tree"].get(pid, 0.0) for pid, cpu in b["tree"].items())
    used["launcher"] = tree - used["training"] - used["rank_other"]
    used["machine_other"] = (b["busy_s"] - a["busy_s"]) - tree
    used["idle"] = b["idle_s"] - a["idle_s"]
    return {k: max(0.0, v) / dt for k, v in used.items()}


class CpuSampler:
    """Snapshots this process's tree every `interval_s` in a background thread while in a `with` block."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.snapshots: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "CpuSampler":
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        root = os.getpid()
        while True:
            self.snapshots.append(snapshot(root))
            if self._stop.wait(self.interval_s):
                return

    def window(self, t0: float, t1: float) -> dict[str, float] | None:
        """Cores used by each class between the first snapshot at or after `t0` and the last at or before `t1`."""
        inside = [s for s in self.snapshots if t0 <= s["t"] <= t1]
        if len(inside) < 2:
            return None
        return classify(inside[0], inside[-1])
