"""Recovery benchmark: how fast each system notices a dead or hung rank, and how fast it trains again.

Three systems, on this machine, in one run, with the same model (the built-in
transformer of `deploy/examples/demo.yaml`), the same data, optimizer, FSDP
data-parallel step and world size:

- elastic:            `elastic.job.run_job` with `kill:` and `hang:...,where=data` injects;
                      numbers come from its report and events.jsonl.
- ray_train:          `ray.train.torch.TorchTrainer`, FailureConfig(max_failures=1),
                      DCP checkpoints through `ray.train.report` every few steps.
- torch_distributed:  N plain gloo processes on 127.0.0.1, no manager.

Faults are real: the rank SIGKILLs its own process at the start of a step
(after writing the kill time to a log), or blocks forever before the step's
data. Every scenario runs in its own subprocess (its own Ray cluster, shut
down at the end); the parent only reads the logs the scenario leaves.

Definitions (the same for every system):
- detect_s:      fault -> the system knows (elastic: `failure_detected`; Ray Train:
                 the first `UserCallback.after_exception` on its controller; plain
                 torch: the first survivor whose collective raises);
- recover_s:     detection -> the first completed training step after the restart;
- fault_to_step_s: fault -> that first step (= detect_s + recover_s);
- hang_detect_s: a rank blocks forever -> the system knows (null: not within the bound).

Usage: python bench/recovery.py [--world 2] [--hang-bound 120] [--pg-timeout 60]
Writes bench/results/recovery.json and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STEPS = 30
EVERY = 5  # checkpoint every this many steps (all systems that checkpoint)
FAULT_STEP = 12  # the fault fires once this many steps are done (2 after the checkpoint of step 10), before the next
FAULT_RANK = 1


def job_overrides(name: str, tmp: Path) -> list[str]:
    sets = {
        "name": name,
        "run_root": str(tmp / "runs"),
        "checkpoint.uri": str(tmp / name / "ckpt"),
        "checkpoint.every_steps": EVERY,
        "training.steps": STEPS,
        "training.global_batch": 16,
        "training.micro_batch": 4,
        "fault.inject": "[]",
    }
    return [f"{k}={v}" for k, v in sets.items()]


def load_cfg(name: str, tmp: Path, world: int):
    from elastic.config import load_config

    over = job_overrides(name, tmp) + [f"scaling.num_workers={world}", f"scaling.min_workers={world}", f"scaling.workers_per_node={world}"]
    return load_config(ROOT / "deploy/examples/demo.yaml", over)


class Log:
    """Append-only JSON-lines log shared by processes of one scenario (each line one write)."""

    def __init__(self, path: str | Path):
        self.path = str(path)

    def emit(self, ev: str, **fields) -> None:
        line = json.dumps({"t": time.time(), "ev": ev, "pid": os.getpid(), **fields}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> list[dict]:
        try:
            text = Path(self.path).read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written right now; the next read has it
        return out


# --------------------------------------------------------------------------------------------
# The data-parallel step shared by the baselines: the same model, data, optimizer, FSDP and
# learning-rate schedule as elastic's Trainer (elastic/train.py), without the manager.
# --------------------------------------------------------------------------------------------
class DPStep:
    def __init__(self, cfg, world: int, rank: int):
        import torch

        from elastic.data import GlobalSampler, SyntheticTokens
        from elastic.layout import Layout
        from elastic.recipe import build_optimizer, build_parallel_model, initialize

        torch.set_num_threads(1)  # as elastic's workers (ELASTIC_TORCH_THREADS=1)
        self.cfg, self.rank = cfg, rank
        self.layout = Layout.for_world(world)
        self.mesh = self.layout.build_mesh("cpu")
        self.pm, whole = build_parallel_model(cfg, self.mesh, torch.device("cpu"))
        t = cfg.training
        self.optimizer = build_optimizer(self.pm.parameters(), t)
        initialize(self.pm, whole, cfg)
        self.data = SyntheticTokens(cfg.data, cfg.model.vocab_size)
        self.sampler = GlobalSampler(len(self.data), cfg.data.seed, t.global_batch)

    def step(self, step: int) -> float:
        from elastic.train import lr_at
        from strategies import clip_grad_norm

        cfg, layout = self.cfg, self.layout
        scale = layout.dp / (cfg.training.global_batch * cfg.data.seq_len)
        indices = self.sampler.rank_indices(step, layout.dp_rank(self.rank), layout.dp)
        inputs, labels = self.data.batch(indices)
        loss_sum = self.pm.forward_backward(inputs, labels, scale)
        clip_grad_norm(self.pm, cfg.training.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)  # the same schedule as elastic's Trainer
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss_sum)

    # Distributed checkpoint (DCP), the way a Ray Train user checkpoints FSDP2 models.
    def _state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        (model,) = self.pm.model_parts
        msd, osd = get_state_dict(model, self.optimizer)
        return {"model": msd, "optim": osd}

    def save(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=path)

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        (model,) = self.pm.model_parts
        state = self._state()
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _fault(kind: str, log: Log, rank: int, step: int) -> None:
    """Fire the fault in this process: log its time first (durably), then die or block."""
    log.emit("fault", kind=kind, rank=rank, step=step)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang: alive, making no progress
        time.sleep(3600)


# --------------------------------------------------------------------------------------------
# elastic
# --------------------------------------------------------------------------------------------
def scenario_elastic(kind: str, tmp: Path, world: int, log: Log) -> dict:
    from elastic.events import read_events
    from elastic.job import run_job

    cfg = load_cfg(f"elastic-{kind}", tmp, world)
    _instrument_worker_group(log)
    spec = f"kill:rank={FAULT_RANK},step={FAULT_STEP}" if kind == "kill" else f"hang:rank={FAULT_RANK},step={FAULT_STEP},where=data"
    t0 = time.time()
    report = run_job(cfg, [spec], fresh=True, quiet=True)
    events = read_events(cfg.run_dir / "events.jsonl")
    out = {"wall_s": time.time() - t0, "state": report["state"], "failures": report["failures"], "world_sizes": report["world_sizes"]}
    steps = [e for e in events if e["event"] == "step"]
    gens = {}
    for e in steps:
        gens.setdefault(e["generation"], []).append(e["step_s"])
    # Steady-state step time: every step but the first of each generation.
    out["step_s_median"] = statistics.median(s for v in gens.values() for s in v[1:]) if steps else None
    out["timeline"] = _elastic_timeline(events)
    return out


def _proc_start_time(pid: int) -> float | None:
    """When a local process was created (wall clock), from /proc."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _instrument_worker_group(log: Log) -> None:
    """Time the sub-phases of RayWorkerGroup.start/shutdown in this (driver) process; elastic itself is unchanged.

    start() = the agents' prepare calls -> one ray.wait for all of them (the rank processes up: warm
    ones reused, new ones spawned and `import torch`, `elastic.train`) -> their start calls -> one
    ray.wait (the training threads are launched). The rank processes' creation times come from
    /proc (same machine).
    """
    import ray

    import elastic.worker_group as wg

    class TimedRay:
        active = False
        waits = 0

        def __getattr__(self, name):
            return getattr(ray, name)

        def wait(self, *a, **kw):
            out = ray.wait(*a, **kw)
            if TimedRay.active:
                TimedRay.waits += 1
                log.emit("wg_wait_done", n=TimedRay.waits)
            return out

    wg.ray = TimedRay()
    orig_start, orig_shutdown = wg.RayWorkerGroup.start, wg.RayWorkerGroup.shutdown

    def start(self, layout, specs, **kw):
        log.emit("wg_start_begin")
        TimedRay.active, TimedRay.waits = True, 0
        try:
            return orig_start(self, layout, specs, **kw)
        finally:
            TimedRay.active = False
            log.emit("wg_start_end", proc_start={m.rank: _proc_start_time(m.pid) for m in self.members if m.pid})

    def shutdown(self):
        log.emit("wg_shutdown_begin", members=len(self.members))
        orig_shutdown(self)
        log.emit("wg_shutdown_end")

    wg.RayWorkerGroup.start, wg.RayWorkerGroup.shutdown = start, shutdown


def _elastic_timeline(events: list[dict]) -> dict:
    """Where the time between the fault and the first step of the next generation goes."""
    fault = next((e for e in events if e["event"] == "fault_injected"), None)
    det = next((e for e in events if e["event"] == "failure_detected"), None)
    if fault is None or det is None:
        return {}
    after = [e for e in events if e["t"] >= det["t"]]
    rec = next((e for e in after if e["event"] == "recovering"), None)
    gen = next((e for e in after if e["event"] == "generation_start"), None)
    running = next((e for e in after if e["event"] == "state" and e["state"] == "RUNNING"), None)
    first = next((e for e in after if e["event"] == "step" and gen and e["generation"] == gen["generation"]), None)
    marks = {"fault": fault["t_fault"], "failure_detected": det["t"]}
    for name, e in (("recovering", rec), ("generation_start", gen), ("running", running)):
        if e:
            marks[name] = e["t"]
    if first:
        marks["first_step_began"] = first["t"] - first["step_s"]  # the worker's t_start of that step
        marks["first_step_done"] = first["t"]
    names = list(marks)
    phases = {f"{a}->{b}": marks[b] - marks[a] for a, b in zip(names, names[1:])}
    return {"marks": marks, "phases_s": phases}


# --------------------------------------------------------------------------------------------
# Ray Train
# --------------------------------------------------------------------------------------------
def _ray_train_loop(config: dict) -> None:
    import tempfile as _tempfile

    import ray.train
    from ray.train import Checkpoint

    from elastic.config import JobConfig

    cfg = JobConfig.model_validate(config["cfg"])
    log = Log(config["log"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log.emit("worker_start", rank=rank)
    dp = DPStep(cfg, world, rank)
    start, restored = 0, False
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            dp.load(d)
            start = json.loads((Path(d) / "train_state.json").read_text())["step"]
        restored = True
    log.emit("ready", rank=rank, start=start, restored=restored)
    for step in range(start, cfg.training.steps):
        if not restored and rank == config["fault_rank"] and step == config["fault_step"]:
            _fault(config["fault"], log, rank, step)
        t0 = time.time()
        loss = dp.step(step)
        log.emit("step", rank=rank, step=step, restored=restored, step_s=time.time() - t0, loss=loss)
        done = step + 1
        if done % config["every"] == 0 or done == cfg.training.steps:
            with _tempfile.TemporaryDirectory() as d:
                dp.save(d)
                if rank == 0:
                    (Path(d) / "train_state.json").write_text(json.dumps({"step": done}))
                ray.train.report({"step": done}, checkpoint=Checkpoint.from_directory(d))


def scenario_ray_train(kind: str, tmp: Path, world: int, log: Log, hang_bound: float, result_path: str) -> dict:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.callback import UserCallback

    class DetectionProbe(UserCallback):
        """Runs on Ray Train's controller: the first time it sees a worker error is its detection."""

        def __init__(self, path: str):
            self.path, self.seen = path, False

        def after_exception(self, run_context, worker_exceptions):
            if not self.seen:
                self.seen = True
                Log(self.path).emit("detect", errors={str(k): str(v).splitlines()[0][:300] for k, v in worker_exceptions.items()})

    cfg = load_cfg(f"ray-{kind}", tmp, world)
    ray.init(address="local", num_cpus=world, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    result: dict = {}
    try:
        trainer = TorchTrainer(
            _ray_train_loop,
            train_loop_config={
                "cfg": cfg.model_dump(mode="json"), "log": log.path, "fault": kind,
                "fault_rank": FAULT_RANK, "fault_step": FAULT_STEP, "every": EVERY,
            },
            scaling_config=ScalingConfig(num_workers=world, use_gpu=False),
            run_config=RunConfig(
                name=f"ray-{kind}", storage_path=str(tmp / "ray_results"),
                failure_config=FailureConfig(max_failures=1),
                checkpoint_config=CheckpointConfig(num_to_keep=3),
                callbacks=[DetectionProbe(log.path)],
            ),
        )
        t0 = time.time()
        fit_error: list = []

        def fit():
            try:
                trainer.fit()
            except BaseException as exc:  # noqa: BLE001 - reported, the scenario still measures
                fit_error.append({"t": time.time(), "error": repr(exc)[:500]})

        th = threading.Thread(target=fit, daemon=True)
        th.start()
        # Wait until the fault fired, then for the restart's first step (or the bound).
        deadline = t0 + 600
        while th.is_alive() and time.time() < deadline:
            evs = log.read()
            fault = next((e for e in evs if e["ev"] == "fault"), None)
            if fault is not None:
                deadline = min(deadline, fault["t"] + hang_bound)
                if any(e["ev"] == "step" and e["restored"] for e in evs):
                    break
            th.join(0.5)
        th.join(30 if not th.is_alive() or kind == "kill" else 0)
        result.update(wall_s=time.time() - t0, ended_at=time.time(), fit_error=list(fit_error), fit_finished=not th.is_alive())
        # Saved before the shutdown: a still-running fit thread may end this process when Ray goes away.
        Path(result_path).write_text(json.dumps(result, default=str))
    finally:
        ray.shutdown()
    return result


# --------------------------------------------------------------------------------------------
# plain torch.distributed
# --------------------------------------------------------------------------------------------
def torch_worker(rank: int, world: int, port: int, kind: str, tmp: Path, log: Log, pg_timeout: float) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    cfg = load_cfg(f"torch-{kind}", tmp, world)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout)
    )
    dp = DPStep(cfg, world, rank)
    log.emit("ready", rank=rank)
    for step in range(cfg.training.steps):
        if rank == FAULT_RANK and step == FAULT_STEP:
            _fault(kind, log, rank, step)
        t0 = time.time()
        try:
            loss = dp.step(step)
        except Exception as exc:  # noqa: BLE001 - the survivor noticed: that is the measurement
            log.emit("error", rank=rank, step=step, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            os._exit(1)
        log.emit("step", rank=rank, step=step, step_s=time.time() - t0, loss=loss)
    dist.barrier()
    dist.destroy_process_group()


def scenario_torch(kind: str, tmp: Path, world: int, log: Log, pg_timeout: float) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--torch-worker", str(r), "--world", str(world), "--port", str(port), "--kind", kind,
             "--tmp", str(tmp), "--log", log.path, "--pg-timeout", str(pg_timeout)],
            cwd=ROOT, start_new_session=True,
        )
        for r in range(world)
    ]
    t0 = time.time()
    bound = pg_timeout + 60  # the survivors get their whole process-group timeout, and a margin
    deadline = t0 + 300
    try:
        while time.time() < deadline:
            evs = log.read()
            fault = next((e for e in evs if e["ev"] == "fault"), None)
            if fault is not None:
                deadline = min(deadline, fault["t"] + bound)
            survivors = [p for r, p in enumerate(procs) if r != FAULT_RANK]
            if fault is not None and all(p.poll() is not None for p in survivors):
                break
            time.sleep(0.2)
    finally:
        for p in procs:  # only the processes this scenario started
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return {"wall_s": time.time() - t0, "bound_s": bound, "exit_codes": [p.returncode for p in procs]}


# --------------------------------------------------------------------------------------------
# analysis of the shared logs
# --------------------------------------------------------------------------------------------
def _median_step(evs: list[dict], **match) -> float | None:
    times = [e["step_s"] for e in evs if e["ev"] == "step" and e["rank"] == 0 and all(e.get(k) == v for k, v in match.items())]
    return statistics.median(times[1:]) if len(times) > 1 else None


def analyse_ray_train(kill: dict, hang: dict, hang_bound: float) -> dict:
    k, h = kill["events"], hang["events"]
    fk = next((e for e in k if e["ev"] == "fault"), None)
    dk = next((e for e in k if e["ev"] == "detect"), None)
    restart = next((e for e in k if fk and e["ev"] == "worker_start" and e["t"] > fk["t"]), None)
    ready = next((e for e in k if e["ev"] == "ready" and e.get("restored")), None)
    first = next((e for e in k if e["ev"] == "step" and e.get("restored")), None)
    fh = next((e for e in h if e["ev"] == "fault"), None)
    dh = next((e for e in h if e["ev"] == "detect"), None)
    detect = dk["t"] - fk["t"] if fk and dk else None
    hang_detect = dh["t"] - fh["t"] if fh and dh and dh["t"] - fh["t"] <= hang_bound else None
    return {
        "detect_s": detect,
        "recover_s": first["t"] - dk["t"] if first and dk else None,
        "fault_to_step_s": first["t"] - fk["t"] if first and fk else None,
        "hang_detect_s": hang_detect,
        "hang_bound_s": hang_bound,
        "step_s_median": _median_step(k, restored=False),
        "timeline": {
            "fault->detect (after_exception on the controller)": detect,
            "detect->new worker's train_func starts": restart["t"] - dk["t"] if restart and dk else None,
            "train_func start->checkpoint restored": ready["t"] - restart["t"] if ready and restart else None,
            "restored->first step done": first["t"] - ready["t"] if first and ready else None,
        },
        "lost_steps": (fk["step"] - first["step"]) if fk and first else None,
        "detect_error": dk.get("errors") if dk else None,
        "hang_error": dh.get("errors") if dh else None,
        "hang_note": "Ray Train has no progress watchdog: a hung rank is only noticed when the survivors' collective "
        "times out (TorchConfig.timeout_s, default 1800 s)",
        "runs": {"kill": {x: kill[x] for x in kill if x != "events"}, "hang": {x: hang[x] for x in hang if x != "events"}},
    }


def analyse_torch(kill: dict, hang: dict, pg_timeout: float) -> dict:
    def first_error(evs):
        f = next((e for e in evs if e["ev"] == "fault"), None)
        err = min((e for e in evs if e["ev"] == "error"), key=lambda e: e["t"], default=None)
        return (err["t"] - f["t"] if f and err else None), err

    detect, kerr = first_error(kill["events"])
    hang_detect, herr = first_error(hang["events"])
    return {
        "detect_s": detect,
        "recover_s": None,
        "fault_to_step_s": None,
        "hang_detect_s": hang_detect,
        "pg_timeout_s": pg_timeout,
        "hang_bound_s": hang["bound_s"],
        "step_s_median": _median_step(kill["events"]),
        "detect_error": kerr["error"] if kerr else None,
        "hang_error": herr["error"] if herr else None,
        "note": "nothing restarts the job: recover_s is null; the survivors only learn of a dead or hung peer from an "
        f"exception in their collective (gloo, process-group timeout {pg_timeout:g} s; torch's default is 1800 s)",
        "runs": {"kill": {x: kill[x] for x in kill if x != "events"}, "hang": {x: hang[x] for x in hang if x != "events"}},
    }


def _worker_group_phases(run: dict) -> dict:
    """Sub-phases of the restart in the elastic run, from the driver-side instrumentation."""
    evs, marks = run["events"], run.get("timeline", {}).get("marks", {})
    det = marks.get("failure_detected")
    if det is None:
        return {}
    after = [e for e in evs if e["t"] >= det]
    sd0 = next((e for e in after if e["ev"] == "wg_shutdown_begin"), None)
    sd1 = next((e for e in after if e["ev"] == "wg_shutdown_end"), None)
    st0 = next((e for e in after if e["ev"] == "wg_start_begin"), None)
    info = next((e for e in after if e["ev"] == "wg_wait_done" and e["n"] == 1), None)
    started = next((e for e in after if e["ev"] == "wg_wait_done" and e["n"] == 2), None)
    st1 = next((e for e in after if e["ev"] == "wg_start_end"), None)
    out = {}
    if sd0 and sd1:
        out["shutdown: the agents kill the rank processes, then ray.kill the agents"] = sd1["t"] - sd0["t"]
    if st0 and info:
        out["rank processes up: agents reuse warm ones or spawn and import torch + elastic.train (prepare)"] = info["t"] - st0["t"]
    if info and started:
        out["agents hand each rank process its spec; the training threads start (start)"] = started["t"] - info["t"]
    if "running" in marks and "first_step_began" in marks:
        out["training thread: TCPStore, init_process_group, mesh, FSDP wrap, checkpoint load"] = marks["first_step_began"] - marks["running"]
    if "first_step_began" in marks and "first_step_done" in marks:
        out["first step (+ the controller's 0.2 s poll)"] = marks["first_step_done"] - marks["first_step_began"]
    if st1 and st1.get("proc_start") and "fault" in marks:
        created = [v for v in st1["proc_start"].values() if v]
        if created:
            out["note: new worker processes were created this long after the fault (negative: a warm spare was already up)"] = max(created) - marks["fault"]
    return out


def import_costs() -> dict:
    """Fresh-interpreter import times on this machine, now: what every new worker process pays."""
    code = ("import time; t0=time.time(); import ray; t1=time.time(); import torch; t2=time.time(); "
            "import elastic.train; t3=time.time(); print(t1-t0, t2-t1, t3-t2)")
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300).stdout.split()
        return {"import ray": float(out[0]), "import torch": float(out[1]), "import elastic.train (after torch)": float(out[2])}
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"error": repr(exc)}


def analyse_elastic(kill: dict, hang: dict) -> dict:
    (fk,) = kill["failures"] or [None]
    (fh,) = hang["failures"] or [None]
    return {
        "restart_breakdown_s": _worker_group_phases(kill),
        "hang_restart_breakdown_s": _worker_group_phases(hang),
        "detect_s": fk["detect_s"] if fk else None,
        "recover_s": fk["recover_s"] if fk else None,
        "fault_to_step_s": fk["detect_s"] + fk["recover_s"] if fk and fk["recover_s"] is not None else None,
        "hang_detect_s": fh["detect_s"] if fh else None,
        "hang_recover_s": fh["recover_s"] if fh else None,
        "hang_culprit": fh["culprit"] if fh else None,
        "step_s_median": kill["step_s_median"],
        "timeline": kill["timeline"],
        "hang_timeline": hang["timeline"],
        "lost_steps": fk["lost_steps"] if fk else None,
        "runs": {"kill": {x: kill[x] for x in kill if x not in ("events", "timeline")},
                 "hang": {x: hang[x] for x in hang if x not in ("events", "timeline")}},
    }


def run_scenario(system: str, kind: str, tmp: Path, args) -> dict:
    """One scenario in a fresh subprocess; returns what it printed (its result) plus its shared log."""
    sub = tmp / f"{system}-{kind}"
    sub.mkdir(parents=True, exist_ok=True)
    log = sub / "log.jsonl"
    out = sub / "result.json"
    cmd = [sys.executable, __file__, "--scenario", system, "--kind", kind, "--tmp", str(sub), "--log", str(log), "--result", str(out),
           "--world", str(args.world), "--hang-bound", str(args.hang_bound), "--pg-timeout", str(args.pg_timeout)]
    t0 = time.time()
    print(f"[recovery] {system} {kind} ...", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, timeout=900, stdout=subprocess.DEVNULL if args.quiet else None)
    res = json.loads(out.read_text()) if out.exists() else {"error": f"scenario exited {proc.returncode} without a result"}
    res["events"] = Log(log).read()
    res["scenario_wall_s"] = time.time() - t0
    print(f"[recovery] {system} {kind} done in {res['scenario_wall_s']:.0f} s", flush=True)
    return res


def machine() -> dict:
    import ray
    import torch

    return {
        "platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "ray": ray.__version__, "loadavg_at_start": os.getloadavg(),
    }


def fmt(v, unit="s") -> str:
    return "never (within bound)" if v is None else f"{v:.2f} {unit}"


def table(res: dict) -> str:
    s = res["systems"]
    rows = [
        ("elastic", s["elastic"]),
        ("Ray Train (TorchTrainer)", s["ray_train"]),
        ("torch.distributed (gloo, no manager)", s["torch_distributed"]),
    ]
    lines = [
        "| system | detect_s (kill) | recover_s (detection → first step) | kill → first step | hang_detect_s | median step |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        hang = fmt(r["hang_detect_s"])
        if r["hang_detect_s"] is None:
            hang = f"not within {r.get('hang_bound_s', 0):g} s"
        rec = "— (no restart)" if name.startswith("torch") else fmt(r["recover_s"])
        k2s = "— (no restart)" if name.startswith("torch") else fmt(r["fault_to_step_s"])
        lines.append(f"| {name} | {fmt(r['detect_s'])} | {rec} | {k2s} | {hang} | {fmt(r['step_s_median'])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hang-bound", type=float, default=120.0, help="how long Ray Train gets to notice a hang")
    ap.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout of the plain torch.distributed run")
    ap.add_argument("--only", default="elastic,ray_train,torch_distributed")
    ap.add_argument("--out", default=str(ROOT / "bench/results/recovery.json"))
    ap.add_argument("--quiet", action="store_true")
    # internal: one scenario / one plain-torch worker
    ap.add_argument("--scenario")
    ap.add_argument("--kind")
    ap.add_argument("--tmp")
    ap.add_argument("--log")
    ap.add_argument("--result")
    ap.add_argument("--torch-worker", type=int)
    ap.add_argument("--port", type=int)
    args = ap.parse_args()

    if args.torch_worker is not None:
        torch_worker(args.torch_worker, args.world, args.port, args.kind, Path(args.tmp), Log(args.log), args.pg_timeout)
        return
    if args.scenario:
        tmp, log = Path(args.tmp), Log(args.log)
        import traceback

        try:
            res = run_one(args, tmp, log)
        except BaseException:
            res = {"error": traceback.format_exc()[-3000:]}
            print(res["error"], file=sys.stderr, flush=True)
        Path(args.result).write_text(json.dumps(res, default=str))
        sys.stdout.flush()
        os._exit(0)  # leave no straggling threads (a hung Ray Train fit) behind
    main_bench(args)


def run_one(args, tmp: Path, log: Log) -> dict:
    if args.scenario == "elastic":
        return scenario_elastic(args.kind, tmp, args.world, log)
    if args.scenario == "ray_train":
        return scenario_ray_train(args.kind, tmp, args.world, log, args.hang_bound, args.result)
    return scenario_torch(args.kind, tmp, args.world, log, args.pg_timeout)


def main_bench(args) -> None:
    t0 = time.time()
    info = machine()
    info["import_costs_s"] = import_costs()
    only = args.only.split(",")
    systems = {}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as d:
        tmp = Path(d)
        if "elastic" in only:
            systems["elastic"] = analyse_elastic(run_scenario("elastic", "kill", tmp, args), run_scenario("elastic", "hang", tmp, args))
        if "ray_train" in only:
            systems["ray_train"] = analyse_ray_train(
                run_scenario("ray_train", "kill", tmp, args), run_scenario("ray_train", "hang", tmp, args), args.hang_bound
            )
        if "torch_distributed" in only:
            systems["torch_distributed"] = analyse_torch(
                run_scenario("torch_distributed", "kill", tmp, args), run_scenario("torch_distributed", "hang", tmp, args), args.pg_timeout
            )
    res = {
        "machine": info,
        "world_size": args.world,
        "model": "built-in transformer of deploy/examples/demo.yaml (dim 64, 2 layers), FSDP over all ranks, gloo on CPU",
        "setup": {"steps": STEPS, "checkpoint_every": EVERY, "fault_step": FAULT_STEP, "fault_rank": FAULT_RANK,
                  "global_batch": 16, "micro_batch": 4},
        "systems": systems,
        "bench_wall_s": None,
    }
    res["machine"]["loadavg_at_end"] = os.getloadavg()
    res["targets"] = targets(systems)
    res["bench_wall_s"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2, default=str) + "\n")
    if {"elastic", "ray_train", "torch_distributed"} <= systems.keys():
        print(table(res))
    print(json.dumps(res["targets"], indent=2))
    print(f"[recovery] wrote {args.out} in {res['bench_wall_s']:.0f} s")


def targets(systems: dict) -> dict:
    e, r = systems.get("elastic"), systems.get("ray_train")
    out = {}
    if e:
        out["detect_s<=1"] = {"value": e["detect_s"], "met": e["detect_s"] is not None and e["detect_s"] <= 1.0}
        limit = max(10.0, 5 * (e["step_s_median"] or 0))
        out["hang_detect_s<=max(10,5*median_step)"] = {
            "value": e["hang_detect_s"], "limit": limit, "met": e["hang_detect_s"] is not None and e["hang_detect_s"] <= limit
        }
    if e and r:
        rr = r["recover_s"]
        out["recover_s<=ray_train/2"] = {
            "value": e["recover_s"], "limit": rr / 2 if rr else None,
            "met": e["recover_s"] is not None and rr is not None and e["recover_s"] <= rr / 2,
        }
        rk = r["fault_to_step_s"]
        out["also: kill->first step <= ray_train/2"] = {
            "value": e["fault_to_step_s"], "limit": rk / 2 if rk else None,
            "met": e["fault_to_step_s"] is not None and rk is not None and e["fault_to_step_s"] <= rk / 2,
        }
    return out


if __name__ == "__main__":
    main()
