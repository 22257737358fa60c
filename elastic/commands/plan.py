"""`elastic plan`: rank the parallel layouts of a model on a cluster, or draw a pipeline schedule.

    elastic plan --params 7e9 --gpus 64 --gpus-per-node 8 --gpu-mem-gb 80 --intra-gbps 900 --inter-gbps 50
    elastic plan --config job.yaml --gpus 16 --json
    elastic plan --timeline 1f1b --stages 4 --microbatches 8

The arithmetic lives in `strategies.planner` and `strategies.schedule_timeline`;
this module only turns arguments into their inputs and their results into text.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from elastic.errors import UsageError
from elastic.config import load_config
from strategies.planner import HEAD_DIM, RUNNABLE, STRATEGIES, Hardware, ModelCheck, ModelProfile, PlanEntry, StepOptions, plan
from strategies.schedule_timeline import SCHEDULES, render_timeline, timeline

_SUFFIXES = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(text: str) -> float:
    """A parameter count as `7e9`, `7000000000`, `7B`, `1.5T` or `350M`."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGT]?)\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (try 7e9 or 7B)")
    value = float(match.group(1)) * _SUFFIXES[match.group(2).upper()]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"parameter count must be > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse type for counts that must be >= 1 (GPUs, batch sizes, stages)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="rank parallel layouts by memory, communication and pipeline bubble",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--params", type=parse_count, help="parameter count (7e9, 7B); the shape is estimated from it")
    model.add_argument("--config", metavar="JOB_YAML", help="job config: exact model shape, batch, schedule and workers")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (with --config)")
    p.add_argument("--gpus", type=positive_int, help="GPUs to plan for (default: scaling.num_workers of --config)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory of one GPU, GB (1e9 bytes)")
    p.add_argument("--intra-gbps", type=float, default=900.0, help="intra-node bandwidth per GPU, GB/s (NVLink-class)")
    p.add_argument("--inter-gbps", type=float, default=50.0, help="inter-node bandwidth per GPU, GB/s (400 Gbit/s = 50)")
    p.add_argument("--tflops", type=float, default=312.0, help="peak dense bf16 TFLOP/s of one GPU (default: an A100's 312)")
    p.add_argument("--mfu", type=float, default=0.4,
                   help="the share of --tflops a step sustains (model FLOPs utilisation; default 0.4, what well-tuned large runs reach): "
                        "weighs the bubble against traffic")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sample (default 2048, or data.seq_len)")
    p.add_argument("--micro-batch", type=positive_int, help="samples per micro-batch (default 1, or training.micro_batch)")
    p.add_argument("--global-batch", type=positive_int, help="samples per step (default gpus x micro-batch, or training.global_batch)")
    p.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (default 1f1b, or parallel.pp_schedule)")
    p.add_argument("--virtual-stages", type=positive_int, help="chunks per stage for interleaved_1f1b (default 2)")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="decide fit with recomputed activations (default off, or parallel.activation_checkpointing)")
    p.add_argument("--top", type=positive_int, default=10, help="show the best K layouts (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--timeline", choices=SCHEDULES, metavar="SCHEDULE", help=f"also draw a schedule: {', '.join(SCHEDULES)}")
    p.add_argument("--stages", type=positive_int, default=4, help="pipeline stages of the drawing (default 4)")
    p.add_argument("--microbatches", type=positive_int, default=8, help="micro-batches of the drawing (default 8)")
    p.set_defaults(func=run)


def _inputs(args: argparse.Namespace) -> tuple[ModelProfile, Hardware, StepOptions, ModelCheck | None]:
    """Model, hardware, step options and the model's layout check from the arguments, the config filling what they leave out.

    With `--config` the model is the job's (its builder, on meta): exact
    parameter counts, and only the layouts it allows.
    """
    cfg = load_config(args.config, args.set) if args.config else None
    if cfg:  # the job's own model, built on meta: torch, which a plan from --params (and `elastic --help`) need not import
        from elastic.planning import model_inputs, step_options
    if args.set and cfg is None:
        raise UsageError("--set needs --config")
    seq_len = args.seq_len or (cfg.data.seq_len if cfg else 2048)
    micro_batch = args.micro_batch or (cfg.training.micro_batch if cfg else 1)
    gpus = args.gpus or (cfg.scaling.num_workers if cfg else None)
    if gpus is None:
        raise UsageError("--gpus is required with --params")
    base = step_options(cfg) if cfg else StepOptions()
    options = StepOptions(
        global_batch=args.global_batch or base.global_batch or gpus * micro_batch,
        schedule=args.schedule or base.schedule,
        virtual_stages=args.virtual_stages or base.virtual_stages,
        activation_checkpointing=base.activation_checkpointing if args.activation_checkpointing is None else args.activation_checkpointing,
        reshard_after_forward=base.reshard_after_forward,
    )
    check = None
    try:
        if cfg:
            model, check = model_inputs(cfg, seq_len=seq_len, micro_batch=micro_batch)
        else:
            model = ModelProfile.from_params(args.params, seq_len=seq_len, micro_batch=micro_batch)
            check = _guessed_heads_check(model)
        hardware = Hardware(gpus=gpus, gpus_per_node=args.gpus_per_node, gpu_mem_bytes=args.gpu_mem_gb * 1e9,
                            intra_bw=args.intra_gbps * 1e9, inter_bw=args.inter_gbps * 1e9, peak_flops=args.tflops * 1e12, mfu=args.mfu)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return model, hardware, options, check


def _guessed_heads_check(model: ModelProfile):
    """For a shape guessed from a parameter count: tp must divide its attention heads (dim / HEAD_DIM), as it would in the model."""
    heads = model.dim // HEAD_DIM

    def check(layout) -> str | None:
        return None if heads % layout.tp == 0 else f"tp={layout.tp} does not divide the {heads} attention heads of the guessed shape"

    return check


def human_count(n: float) -> str:
    """A parameter count as people write it: 350M, 7B, 1.5T (`parse_count` reads these back); 1e+15 past the trillions."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        value = float(f"{n / scale:.3g}")  # rounded first, so 999.9e9 is 1T, not 1e+03B
        if 1 <= value < 1000:
            return f"{value:g}{suffix}"
    return f"{n:.3g}"


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f}"


COLUMNS = ("#", "pp x rep x shard x tp", "fits", "mem GB", "state GB", "DP*", "Z1*", "Z2", "Z3", "act GB", "act+AC GB",
           "intra GB", "inter GB", "m", "bubble", "step s")


def _row(i: int, e: PlanEntry) -> list[str]:
    """One table row: totals first, then model state under each strategy, activations, traffic, pipeline, time."""
    s = e.model_state
    return [str(i), "x".join(map(str, e.layout.shape)), "yes" if e.fits else "no", _gb(e.total_bytes), _gb(e.state_bytes),
            _gb(s["dp"]), _gb(s["zero1"]), _gb(s["zero2"]), _gb(s["zero3"]), _gb(e.activation_bytes), _gb(e.activation_bytes_ckpt),
            _gb(e.intra_bytes), _gb(e.inter_bytes), str(e.microbatches), f"{e.bubble:.1%}", f"{e.step_s:.3g}"]


def _summary(model: ModelProfile, hw: Hardware, options: StepOptions, shown: int, total: int, guessed: bool) -> str:
    fits = "activation checkpointing" if options.activation_checkpointing else "full activations"
    shape = f" (shape guessed from the count: {model.dim // HEAD_DIM} heads of {HEAD_DIM})" if guessed else ""
    return (f"{human_count(model.params)} parameters, {model.n_layers} layers, dim {model.dim}{shape}, seq {model.seq_len}, micro-batch {model.micro_batch}; "
            f"{hw.gpus} GPUs ({hw.gpus_per_node}/node, {hw.gpu_mem_bytes / 1e9:g} GB, {hw.intra_bw / 1e9:g}/{hw.inter_bw / 1e9:g} GB/s intra/inter, "
            f"compute at {hw.mfu:.0%} of {hw.peak_flops / 1e12:g} TFLOP/s peak); "
            f"schedule {options.schedule}; fit with {fits}; best {shown} of {total} layouts. "
            "mem = state (HSDP over dp_shard) + activations + gathered blocks; DP/Z1/Z2/Z3 = model state under plain DP and ZeRO-1/2/3 "
            "over the whole data-parallel group (* for comparison only: the runtime runs Z3, Z2 = parallel.reshard_after_forward false, "
            "and HSDP, not plain DP or ZeRO-1); traffic per GPU and step")


def _plain_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [list(COLUMNS)] + rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in [list(COLUMNS)] + rows)


def _print_table(summary: str, rows: list[list[str]]) -> None:
    """A rich table on a terminal; aligned plain text when piped, so scripts and logs stay readable."""
    if not sys.stdout.isatty():
        print(summary)
        print(_plain_table(rows))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(caption=summary, caption_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*r, style=None if r[2] == "yes" else "dim")
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    if args.params is None and args.config is None and args.timeline is None:
        raise UsageError("give --params or --config (or --timeline to draw a schedule)")
    out: dict = {}
    if args.params is not None or args.config is not None:
        model, hardware, options, check = _inputs(args)
        entries = plan(model, hardware, options, check)
        if not entries:
            raise UsageError(f"no valid layout for {hardware.gpus} GPUs with {hardware.gpus_per_node} per node "
                             f"and global batch {options.global_batch}")
        shown = entries[: args.top]
        if args.json:
            out.update(model={**model.__dict__, "params": model.params}, hardware={**hardware.__dict__, "flops": hardware.flops},
                       options=options.__dict__, runnable={s: s in RUNNABLE for s in STRATEGIES},
                       total_layouts=len(entries), layouts=[e.to_dict() for e in shown])
        else:
            summary = _summary(model, hardware, options, len(shown), len(entries), guessed=args.config is None)
            _print_table(summary, [_row(i + 1, e) for i, e in enumerate(shown)])
    if args.timeline:
        drawing = (args.timeline, args.stages, args.microbatches, args.virtual_stages or 2)
        try:
            if args.json:
                chunks = drawing[3] if args.timeline == "interleaved_1f1b" else 1
                out["timeline"] = {"schedule": args.timeline, "stages": args.stages, "microbatches": args.microbatches,
                                   "rows": [[None if op is None else op.label(chunks) for op in row] for row in timeline(*drawing)]}
            else:
                print(("\n" if out or args.params is not None or args.config is not None else "") + render_timeline(*drawing))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(out, indent=2))
    return 0
