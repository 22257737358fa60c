"""The baseline: the same `Trainer` as plain torch.distributed processes, without Ray or the controller.

`run_plain(cfg)` spawns one process per rank on this machine, joins them in a
gloo process group on 127.0.0.1, and runs exactly what a rank process runs in
its training thread (`elastic.train.Trainer(spec, progress).run()`) with the
same job config and the layout the manager's scaling policy would choose for
`scaling.num_workers` ranks. Each rank returns the records its `Progress`
collected (`step` records carry `t_start`, the completion time `t`, and on
the data reporters `loss_sum`), so a benchmark can time both launchers from
the same records.

As a command, it runs one job config without the manager and prints the
per-step losses and median step time:

    python bench/plain.py deploy/examples/demo.yaml --set fault.inject=[] --set training.steps=20
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from elastic.config import JobConfig, load_config  # noqa: E402
from elastic.layout import Layout  # noqa: E402


def torch_threads() -> int:
    """The intra-op thread count a rank process uses (`elastic/rank_process.py`): the same rule here."""
    return max(1, int(os.environ.get("ELASTIC_TORCH_THREADS", "1")))


def layout_for(cfg: JobConfig) -> Layout:
    """The layout the controller's scaling policy picks for `scaling.num_workers` workers."""
    from elastic.policies import ScalingPolicy

    decision = ScalingPolicy(cfg).decide(cfg.scaling.num_workers, None)
    if decision.layout is None:
        raise ValueError(decision.reason)
    return decision.layout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, config: dict, layout: dict, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from elastic.train import Progress, RankSpec, Trainer

    torch.set_num_threads(torch_threads())
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
        )
        progress = Progress()
        spec = RankSpec(config=config, layout=layout, rank=rank, generation=1, device="cpu")
        Trainer(spec, progress).run()
        # Same teardown as a rank process: gloo needs a barrier before destroy.
        dist.barrier()
        dist.destroy_process_group()
        records = [r for r in progress.drain() if r["kind"] in ("ready", "step")]
        (Path(out_dir) / f"{rank}.json").write_text(json.dumps(records))
    except BaseException:
        (Path(out_dir) / f"{rank}.err").write_text(traceback.format_exc())
        raise


def run_plain(cfg: JobConfig, layout: Layout | None = None) -> list[list[dict]]:
    """Run `cfg` on `layout` (default: the manager's choice) as plain processes; return each rank's records."""
    import torch.multiprocessing as mp

    layout = layout or layout_for(cfg)
    world = layout.world_size
    # A rank process gets OMP_NUM_THREADS from its agent (= its CPUs, 1 by default); match it.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, int(cfg.scaling.cpus_per_worker))))
    with tempfile.TemporaryDirectory(prefix="plain-") as out_dir:
        args = (world, _free_port(), cfg.model_dump(mode="json"), layout.as_dict(), out_dir)
        try:
            mp.start_processes(_rank_main, args=args, nprocs=world, start_method="spawn")
        except Exception as exc:
            errors = sorted(Path(out_dir).glob("*.err"))
            detail = errors[0].read_text() if errors else ""
            raise RuntimeError(f"plain torch.distributed run failed: {exc}\n{detail}") from None
        return [json.loads((Path(out_dir) / f"{r}.json").read_text()) for r in range(world)]


def losses_from(records: list[list[dict]], cfg: JobConfig) -> list[float]:
    """Per-step mean token loss, summed over the data reporters exactly as the controller does."""
    sums: dict[int, float] = {}
    for rank_records in records:
        for r in rank_records:
            if r["kind"] == "step" and "loss_sum" in r:
                sums[r["step"]] = sums.get(r["step"], 0.0) + r["loss_sum"]
    tokens = cfg.training.global_batch * cfg.data.seq_len
    return [sums[s] / tokens for s in sorted(sums)]


def step_done_times(records: list[list[dict]]) -> dict[int, float]:
    """When each step was complete: its slowest rank's `step` record time."""
    done: dict[int, float] = {}
    for rank_records in records:
        for r in rank_records:
            if r["kind"] == "step":
                done[r["step"]] = max(done.get(r["step"], 0.0), r["t"])
    return done


def step_times(records: list[list[dict]], first: int = 0, last: int | None = None) -> dict[int, float]:
    """Seconds per step from the ranks' own step records: the gap between consecutive step completions.

    A step is complete when its slowest rank recorded it (`t`, taken right
    after the optimizer step, before any checkpoint save), so step k's time is
    done(k) - done(k-1): data, forward/backward, optimizer and whatever else
    ran on the ranks in between. Steps `first`..`last` (inclusive) are kept.
    """
    done = step_done_times(records)
    last = max(done) if last is None else last
    return {s: done[s] - done[s - 1] for s in sorted(done) if first <= s <= last and s - 1 in done}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    with tempfile.TemporaryDirectory(prefix="plain-ckpt-") as ckpt:
        cfg.checkpoint.uri = ckpt  # the last step saves; keep it out of the config's checkpoint directory
        records = run_plain(cfg)
    times = step_times(records)
    for step, loss in enumerate(losses_from(records, cfg)):
        print(f"step {step:4d} loss {loss:.6f}" + (f" step_s {times[step]:.4f}" if step in times else ""))
    if times:
        print(f"median step_s {statistics.median(times.values()):.4f} over {len(times)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
