"""`elastic run CONFIG.yaml`: train a job elastically on Ray (embedded when no cluster is given)."""

from __future__ import annotations

import json

from elastic.config import load_config
from elastic.preflight import check_job


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run a training job", description=__doc__)
    p.add_argument("config", help="job YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. training.steps=50")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC", help="inject a fault, e.g. kill:rank=1,step=30 (see docs)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else an embedded local cluster)")
    p.add_argument("--fresh", action="store_true", help="delete the run directory and checkpoints first")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_run)


def _run(args) -> int:
    cfg = load_config(args.config, args.overrides)
    print(check_job(cfg, args.inject).summary, flush=True)  # the layout it starts with, before Ray starts (run_job checks again)
    from elastic.job import run_job, succeeded  # after the checks: it imports torch and Ray, seconds a refusal need not wait

    report = run_job(cfg, args.inject, address=args.address, fresh=args.fresh, quiet=args.quiet)
    summary = {k: report[k] for k in ("state", "steps_completed", "initial_loss", "final_loss", "world_sizes", "samples", "goodput", "goodput_training")}
    summary["failures"] = [{k: f[k] for k in ("kind", "rank", "detect_s", "recover_s", "lost_steps")} for f in report["failures"]]
    print(json.dumps(summary, indent=2, default=str))
    print(f"report: {cfg.run_dir / 'report.json'}")
    return 0 if succeeded(report) else 1
