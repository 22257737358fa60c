"""`elastic ckpt`: see what checkpoints a URI holds, what is in one, and whether it is intact; export the model.

    elastic ckpt list URI                 committed checkpoints, newest first
    elastic ckpt inspect URI [--step N]   layout, train state, files and tensors of one (default: newest)
    elastic ckpt verify URI [--step N | --all]   every checksum; exit 1 if anything fails
    elastic ckpt export URI_OR_RUN [--step N] [--format safetensors] OUT_DIR
                                          the model weights as sharded safetensors + index (and, for a
                                          Hugging Face model, what `from_pretrained` needs)

URI is a directory, `file://`, `memory://` or `s3://` prefix; for `export` it
may also be a run directory (`runs/<name>`), whose checkpoints are used. The
work lives in `storage`; this module turns its results into text (or JSON with `--json`).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import storage
from elastic.errors import UsageError
from storage.fs import Store


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ckpt", help="list, inspect and verify checkpoints", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    for name, help_text in (("list", "committed checkpoints, newest first"),
                            ("inspect", "layout, train state, files and tensors of a checkpoint"),
                            ("verify", "check every file and piece checksum")):
        q = sub.add_parser(name, help=help_text)
        q.add_argument("uri", metavar="URI")
        q.add_argument("--json", action="store_true", help="machine-readable output")
        if name != "list":
            q.add_argument("--step", type=int, help="the checkpoint's step (default: the newest committed)")
        if name == "verify":
            q.add_argument("--all", action="store_true", help="verify every committed checkpoint")
        q.set_defaults(func=globals()[f"_{name}"])
    q = sub.add_parser("export", help="write the model weights as safetensors files (Hugging Face layout)")
    q.add_argument("uri", metavar="URI_OR_RUN", help="checkpoint URI, or a run directory (runs/<name>)")
    q.add_argument("out_dir", metavar="OUT_DIR", help="directory (or fsspec URI) to write")
    q.add_argument("--step", type=int, help="the checkpoint's step (default: the newest committed)")
    q.add_argument("--format", choices=("safetensors",), default="safetensors", help="output format")
    q.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="convert the weights (default: as stored)")
    q.add_argument("--max-shard-gb", type=float, default=5.0, help="largest weights file, GB (default 5)")
    q.set_defaults(func=_export)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, unit = float(n), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.1f} {unit}"


def _layout(layout: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items()) or "-"


def _absent(uri: str) -> str | None:
    """Why `uri` holds no checkpoint directory at all (missing, or a file), or None when it exists."""
    store = Store(uri)
    if store.local is not None:
        if store.local.is_dir():
            return None
        return "not a directory" if store.local.exists() else "no such directory"
    return None if store.exists("") else "nothing is stored there"


def _created(unix: float | None) -> str:
    """The manifest's creation time in UTC, or `-` where the manifest does not say."""
    if not isinstance(unix, (int, float)):
        return "-"
    try:
        return datetime.datetime.fromtimestamp(unix, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return "-"


def _must_exist(uri: str) -> None:
    """A UsageError (exit 2) when `uri` does not exist: a mistyped path is not a URI that holds no checkpoints."""
    why = _absent(uri)
    if why:
        raise UsageError(f"{uri}: {why}")


def _checkpoints(uri: str) -> list[dict]:
    """`storage.list_checkpoints(uri)` of a `uri` that exists."""
    entries = storage.list_checkpoints(uri)
    if not entries:
        _must_exist(uri)
    return entries


def _list(args) -> int:
    entries = _checkpoints(args.uri)
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    if not entries:
        print(f"no committed checkpoints under {args.uri}")
        return 0
    print(f"{'step':>10}  {'size':>10}  {'files':>5}  {'tensors':>7}  {'created (UTC)':<19}  layout")
    for e in entries:
        if "error" in e:
            print(f"{e['step']:>10}  BROKEN: {e['error']}")
            continue
        print(f"{e['step']:>10}  {_size(e['bytes']):>10}  {e['files']:>5}  {e['tensors']:>7}  {_created(e['created_unix']):<19}  {_layout(e['layout'])}")
    return 0


def _step(uri: str, step: int | None) -> int:
    """The checkpoint `--step` names, else the newest committed one, of a `uri` that exists."""
    if step is not None:
        _must_exist(uri)
        return step
    entries = _checkpoints(uri)
    if not entries:
        raise UsageError(f"no committed checkpoints under {uri}")
    return entries[0]["step"]


def _inspect(args) -> int:
    step = _step(args.uri, args.step)
    m = storage.read_manifest(args.uri, step)
    if args.json:
        print(json.dumps(m, indent=1))
        return 0
    print(f"checkpoint {args.uri} step {step}")
    print(f"  layout       {_layout(m['layout'])}")
    print(f"  train_state  {json.dumps(m['train_state'], sort_keys=True)}")
    print(f"  data         {_size(m['bytes'])} in {len(m['files'])} files, {m['index']['rows']} pieces")
    for rel, f in m["files"].items():
        print(f"    {rel}  {_size(f['bytes'])}  crc32={f['crc32']:08x}")
    print(f"  tensors      {len(m['tensors'])}")
    for key, t in m["tensors"].items():
        print(f"    {key}  {t['dtype']}{t['shape']}")
    return 0


def _verify(args) -> int:
    if args.all and args.step is not None:
        raise UsageError("give --step or --all, not both")
    if args.all:
        steps = [e["step"] for e in _checkpoints(args.uri)]
        if not steps:
            raise UsageError(f"no committed checkpoints under {args.uri}")
    else:
        steps = [_step(args.uri, args.step)]
    results = []
    for step in steps:
        try:
            m = storage.verify(args.uri, step)
            results.append({"step": step, "ok": True, "bytes": m["bytes"], "files": len(m["files"])})
        except storage.CheckpointError as exc:
            results.append({"step": step, "ok": False, "error": str(exc)})
    if args.json:
        print(json.dumps(results, indent=1))
    for r in [] if args.json else results:
        if r["ok"]:
            print(f"step {r['step']}: OK ({_size(r['bytes'])} in {r['files']} files, every checksum matches)")
        else:
            print(f"step {r['step']}: FAILED: {r['error']}")
    return 0 if all(r["ok"] for r in results) else 1


def _checkpoint_of(arg: str) -> tuple[str, dict | None]:
    """(checkpoint URI, the job's config if known) of a checkpoint URI or a run directory."""
    events = Path(arg) / "events.jsonl"
    if "://" in arg or not events.is_file():
        return arg, None
    from elastic.events import read_events

    config = next((e["config"] for e in read_events(events) if e["event"] == "job_start"), None)
    if config is None:
        raise UsageError(f"{events}: no job_start event to find the run's checkpoints from")
    return config["checkpoint"]["uri"] or str(Path(arg) / "checkpoints"), config


def _model_files(model: dict | None, dtype) -> dict[str, bytes]:
    """What the model's spec writes next to exported weights (a Hugging Face config.json, ...); none when unknown."""
    if model is None:
        return {}
    from elastic.config import ModelConfig
    from elastic.recipe import build_model

    _, spec = build_model(ModelConfig.model_validate(model))
    return spec.export_files(dtype) if spec.export_files is not None else {}


def _export(args) -> int:
    import torch

    uri, config = _checkpoint_of(args.uri)
    step = _step(uri, args.step)
    manifest = storage.read_manifest(uri, step)
    model = manifest["train_state"].get("model") or (config or {}).get("model")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    stored = {t["dtype"] for k, t in manifest["tensors"].items() if k.startswith("model.")}
    if not stored:
        raise UsageError(f"{uri} step {step}: no model weights in the checkpoint")
    extra = _model_files(model, dtype or getattr(torch, max(stored)))  # a config names one dtype: the weights' (they share one)
    index = storage.export_checkpoint(uri, step, args.out_dir, dtype=dtype, max_shard_bytes=int(args.max_shard_gb * 1e9), extra_files=extra)
    files = sorted(set(index["weight_map"].values()))
    print(f"exported step {step} of {uri}: {len(index['weight_map'])} tensors, {_size(index['metadata']['total_size'])} "
          f"in {len(files)} safetensors files" + (f" + {', '.join(sorted(extra))}" if extra else "") + f" -> {args.out_dir}")
    return 0
