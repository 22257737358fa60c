"""Data path: read throughput of the `tokens` source against plain reads of the same bytes, and against what training consumes.

One process, one thread, as one rank reads: the rank's batches of `--batch`
windows (seq_len + 1 tokens each) through `elastic.tokens.TokenWindows`
(the Trainer's `data.batch(indices)`: int64 torch tensors of inputs and
labels), in two orders: sequential (window indices in order) and shuffled
(the job's global order, `GlobalSampler`). Each is timed against the same
windows read the plain way, which is the limit:

- `.bin` (uint16), local: numpy memmap slices of the same windows, stacked
  into int64 and made into the same tensors;
- Parquet (one row per document, row groups of ~1M tokens), local: pyarrow
  decoding the whole token column into memory (at the first read, timed)
  and the same windows cut from it: the cheapest way to this file's
  windows, for a corpus that fits in memory; and, for the tokens source's
  cache smaller than the corpus, plain pyarrow in the same memory: each
  window's row group read with `read_row_group`, the decoded groups kept in
  an LRU of the same size (the like-for-like limit; the whole column in
  memory is reported beside it);
- `s3://` (a moto server on 127.0.0.1; a smaller corpus, `--s3-tokens`,
  because moto copies the whole object for every range GET): `.bin` windows
  by range as pyarrow's S3FileSystem serves them (`read_at`, 16 in flight,
  as `storage.fs.Store` reads), and the Parquet file decoded whole through
  the same client, windows cut from memory.

Then it runs three jobs on the embedded Ray, no faults, synthetic data (no
read cost), and takes each one's median step time after the first quarter:
the tokens per second each rank's training consumes (a rank reads its
data-parallel slice: global batch x seq_len / dp per step):

- the demo (`deploy/examples/demo.yaml`: 4 workers, dp=4, global batch 32
  of 16 tokens), `--demo-steps` steps;
- the Hugging Face Llama example (`examples/hf_llama.py`) at the tiny
  config the README-path test runs (`tests/test_your_model_your_data.py`:
  hidden 32, 2 layers, 2 workers at tp=2, global batch 8 of 16 tokens) and
  at the README's job config (hidden 256, 4 layers, 4 workers at tp=2,
  global batch 32 of 256 tokens), `--hf-steps` steps each.

The `tokens` source is also read at the demo's seq_len (16), where
per-window costs weigh most.

Figures are tokens/s (labels: seq_len per window), medians of `--rounds`
rounds; each measurement runs the corpus once or `--seconds`, whichever is
first. Writes `bench/results/data.json` and prints the table for
`bench/README.md`. Run with `make bench-data`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from bench.s3 import _free_port, start_moto  # noqa: E402
from elastic.config import load_config  # noqa: E402
from elastic.data import GlobalSampler, describe, open_datasets  # noqa: E402

VOCAB = 50_000


def write_corpus(root: Path, tokens: int) -> None:
    """The same token stream twice: a flat uint16 .bin file, and a Parquet file of documents (EOS-free, so the streams match)."""
    rng = np.random.default_rng(0)
    flat = rng.integers(0, VOCAB, tokens, dtype=np.uint16)
    (root / "bin").mkdir(parents=True)
    flat.tofile(root / "bin" / "tokens.bin")
    lengths = rng.integers(200, 2000, tokens // 200)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    offsets = offsets[offsets <= tokens]
    offsets[-1] = tokens
    docs = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))
    (root / "parquet").mkdir()
    rows_per_group = int(len(docs) / (tokens / (1 << 20)))  # ~1M tokens per row group
    pq.write_table(pa.table({"input_ids": docs}), root / "parquet" / "tokens.parquet", row_group_size=rows_per_group)


def _dataset(path: str, seq_len: int, cache_mb: int = 256):
    """A reader of the corpus's windows: `reader()` opens the dataset afresh (an empty cache), its `batch` reads."""
    cfg = load_config(data={"model": {"vocab_size": VOCAB, "max_seq_len": max(seq_len, 32)},
                            "data": {"kind": "tokens", "path": path, "seq_len": seq_len, "cache_mb": cache_mb},
                            "training": {"global_batch": 8, "micro_batch": 8}})
    info = describe(cfg)
    return lambda: open_datasets(cfg, info)[0].batch


def _batches(n: int, batch: int, shuffled: bool) -> list[list[int]]:
    if shuffled:
        sampler = GlobalSampler(n, 1234, batch)
        return [sampler.global_indices(s) for s in range(n // batch)]
    return [list(range(i, i + batch)) for i in range(0, n - batch + 1, batch)]


def _timed(reader, batches: list[list[int]], seq_len: int, seconds: float) -> float:
    """Tokens/s of `read(indices)` over `batches` for a fresh `read = reader()`, stopping after `seconds`."""
    read = reader()
    t0, done = time.perf_counter(), 0
    for indices in batches:
        read(indices)
        done += len(indices)
        if time.perf_counter() - t0 > seconds:
            break
    return done * seq_len / (time.perf_counter() - t0)


def _tensors(rows: np.ndarray):
    full = torch.from_numpy(rows)
    return full[:, :-1].contiguous(), full[:, 1:].contiguous()


def plain_memmap(path: Path, seq_len: int):
    def reader():
        mm = np.memmap(path, dtype=np.uint16, mode="r")
        return lambda indices: _tensors(np.stack([mm[i * seq_len : i * seq_len + seq_len + 1] for i in indices]).astype(np.int64))

    return reader


def plain_parquet(source, seq_len: int):
    """The whole token column decoded by pyarrow (at the first read, inside the timing), windows cut from it."""

    def reader():
        tokens = None

        def read(indices):
            nonlocal tokens
            if tokens is None:
                table = pq.ParquetFile(source() if callable(source) else source).read(columns=["input_ids"])
                tokens = table.column(0).combine_chunks().flatten().to_numpy()
            return _tensors(np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in indices]).astype(np.int64))

        return read

    return reader


def plain_parquet_groups(path: str, seq_len: int, budget_mb: int):
    """Plain pyarrow in `budget_mb` of memory: each window's row groups read with `read_row_group`, decoded groups kept in an LRU."""

    def reader():
        pf = pq.ParquetFile(path)
        tokens = [pf.metadata.row_group(g).column(0).num_values for g in range(pf.num_row_groups)]  # no nulls: values are tokens
        starts = np.concatenate([[0], np.cumsum(tokens)]).tolist()
        groups: OrderedDict = OrderedDict()

        def group(g: int) -> np.ndarray:
            if g not in groups:
                groups[g] = pf.read_row_group(g, columns=["input_ids"]).column(0).combine_chunks().flatten().to_numpy()
                while sum(t.nbytes for t in groups.values()) > budget_mb << 20 and len(groups) > 1:
                    groups.popitem(last=False)
            groups.move_to_end(g)
            return groups[g]

        def window(i: int) -> np.ndarray:
            lo, hi = i * seq_len, i * seq_len + seq_len + 1
            g = int(np.searchsorted(starts, lo, side="right")) - 1
            parts = []
            while lo < hi:
                end = min(hi, starts[g + 1])
                parts.append(group(g)[lo - starts[g] : end - starts[g]])
                lo, g = end, g + 1
            return parts[0] if len(parts) == 1 else np.concatenate(parts)

        return lambda indices: _tensors(np.stack([window(i) for i in indices]).astype(np.int64))

    return reader


def plain_s3_ranges(fs, path: str, seq_len: int, threads: int = 16):
    pool = ThreadPoolExecutor(max_workers=threads)

    def read(indices):
        with fs.open_input_file(path) as f:
            chunks = list(pool.map(lambda i: f.read_at((seq_len + 1) * 2, i * seq_len * 2), indices))
        return _tensors(np.stack([np.frombuffer(c, dtype=np.uint16) for c in chunks]).astype(np.int64))

    return lambda: read


HF_TINY = {"args": {"vocab_size": 258, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False},
           "seq_len": 16, "tp": 2, "workers": 2, "global_batch": 8, "micro_batch": 4}
"""The tiny Llama that tests/test_your_model_your_data.py trains."""
HF_README = {"args": {"vocab_size": 258, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
                      "num_key_value_heads": 4, "tie_word_embeddings": False},
             "seq_len": 256, "tp": 2, "workers": 4, "global_batch": 32, "micro_batch": 4}
"""The job YAML of the README's "Your model on your data"."""


def hf_config(job: dict, name: str, steps: int, run_root: Path):
    return load_config(data={
        "name": name, "run_root": str(run_root),
        "model": {"builder": "examples.hf_llama:build", "args": job["args"]},
        "data": {"seq_len": job["seq_len"]},
        "parallel": {"tp": job["tp"]},
        "scaling": {"num_workers": job["workers"], "min_workers": job["workers"]},
        "training": {"steps": steps, "global_batch": job["global_batch"], "micro_batch": job["micro_batch"]},
        "checkpoint": {"every_steps": steps},
    })


def training_tokens_per_rank_s(cfg) -> dict:
    """Run `cfg` to the end; the tokens per second one rank reads: its data-parallel slice of a step over the median step time."""
    from elastic.events import read_events
    from elastic.job import run_job

    report = run_job(cfg, quiet=True, fresh=True)
    steps = cfg.training.steps
    step_s = [e["step_s"] for e in read_events(cfg.run_dir / "events.jsonl") if e["event"] == "step"][steps // 4 :]
    median = statistics.median(step_s)
    layout = report["layouts"][0]
    dp = layout["dp_replicate"] * layout["dp_shard"]
    per_rank = cfg.training.global_batch * cfg.data.seq_len / dp / median
    return {"state": report["state"], "world_size": report["world_sizes"][0], "layout": layout, "steps": steps, "median_step_s": median,
            "tokens_per_rank_s": per_rank, "global_batch": cfg.training.global_batch, "seq_len": cfg.data.seq_len}


def consumers(demo_steps: int, hf_steps: int, run_root: Path) -> dict:
    """What one rank of each example job consumes (tokens/s): the demo, the tiny HF Llama of the tests, the README's HF Llama."""
    sets = {"run_root": str(run_root), "name": "bench-data-demo", "training.steps": demo_steps, "checkpoint.every_steps": demo_steps,
            "fault.inject": "[]"}
    out = {"demo": training_tokens_per_rank_s(load_config(ROOT / "deploy/examples/demo.yaml", [f"{k}={v}" for k, v in sets.items()]))}
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed (pip install -e '.[hf]'): the Hugging Face jobs are left out", flush=True)
        return out
    for name, job in (("hf_tiny", HF_TINY), ("hf_readme", HF_README)):
        out[name] = training_tokens_per_rank_s(hf_config(job, f"bench-data-{name}", hf_steps, run_root))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64 << 20, help="tokens in the local corpus (default 64M: 128 MB as uint16)")
    ap.add_argument("--s3-tokens", type=int, default=8 << 20, help="tokens in the s3 corpus (default 8M: moto copies the whole object for every range GET)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="windows per read (one rank's local batch)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0, help="time limit of one measurement")
    ap.add_argument("--demo-steps", type=int, default=60)
    ap.add_argument("--hf-steps", type=int, default=8, help="steps of each Hugging Face Llama job (the README config takes seconds a step here)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/data.json"))
    args = ap.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench-data-"))
    loadavg_start = os.getloadavg()
    write_corpus(work, args.tokens)
    write_corpus(work / "s3", args.s3_tokens)
    L = args.seq_len
    n = (args.tokens - 1) // L
    bin_file, parquet_file = work / "bin" / "tokens.bin", str(work / "parquet" / "tokens.parquet")
    cases: dict[str, tuple] = {}  # name -> (the tokens source's measure, the plain read's measure): seconds -> tokens/s

    def windows(reader, batches, seq_len):
        return partial(_timed, reader, batches, seq_len)

    for order in ("sequential", "shuffled"):
        batches = _batches(n, args.batch, order == "shuffled")
        cases[f".bin local, {order}"] = (windows(_dataset(str(work / "bin"), L), batches, L),
                                         windows(plain_memmap(bin_file, L), batches, L))
        for cache in (256, 32) if order == "shuffled" else (256,):  # 256 MB holds the corpus's decoded tokens, 32 MB a quarter
            cases[f"Parquet local, {order}, cache {cache} MB"] = (windows(_dataset(str(work / "parquet"), L, cache_mb=cache), batches, L),
                                                                 windows(plain_parquet(parquet_file, L), batches, L))
        if order == "shuffled":  # the cache a quarter of the corpus: plain pyarrow in the same memory is the like-for-like limit
            cases["Parquet local, shuffled, cache 32 MB, plain in 32 MB"] = (
                windows(_dataset(str(work / "parquet"), L, cache_mb=32), batches, L), windows(plain_parquet_groups(parquet_file, L, 32), batches, L))
    demo_len = 16
    small = _batches((args.tokens - 1) // demo_len, 32, True)[:20_000]
    cases[".bin local, shuffled, seq_len 16"] = (windows(_dataset(str(work / "bin"), demo_len), small, demo_len),
                                                 windows(plain_memmap(bin_file, demo_len), small, demo_len))

    port = _free_port()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    moto = start_moto(port, work / "moto.log")
    results: dict[str, dict] = {}
    try:
        import pyarrow.fs as pafs
        import s3fs

        for part in ("bin", "parquet"):
            s3fs.S3FileSystem(skip_instance_cache=True).put(str(work / "s3" / part), f"s3://bench/{part}", recursive=True)
        afs = pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1",
                                endpoint_override=f"127.0.0.1:{port}", scheme="http")
        n_s3 = (args.s3_tokens - 1) // L
        shuffled, sequential = _batches(n_s3, args.batch, True), _batches(n_s3, args.batch, False)
        cases[".bin s3, shuffled"] = (windows(_dataset("s3://bench/bin", L), shuffled, L),
                                      windows(plain_s3_ranges(afs, "bench/bin/tokens.bin", L), shuffled, L))
        cases["Parquet s3, sequential"] = (windows(_dataset("s3://bench/parquet", L), sequential, L),
                                           windows(plain_parquet(lambda: afs.open_input_file("bench/parquet/tokens.parquet"), L), sequential, L))
        for name, (ours, plain) in cases.items():
            samples = {"ours": [], "plain": []}
            for r in range(args.rounds):
                for side in ("ours", "plain") if r % 2 == 0 else ("plain", "ours"):
                    samples[side].append((ours if side == "ours" else plain)(args.seconds))
            med = {k: statistics.median(v) for k, v in samples.items()}
            results[name] = {"tokens_source_tokens_s": round(med["ours"]), "plain_tokens_s": round(med["plain"]),
                             "ratio": round(med["ours"] / med["plain"], 3), "samples": samples}
            print(f"{name}: tokens source {med['ours']:,.0f} tokens/s, plain {med['plain']:,.0f}, ratio {med['ours'] / med['plain']:.2f}", flush=True)
    finally:
        moto.terminate()
        moto.wait(timeout=30)

    training = consumers(args.demo_steps, args.hf_steps, work / "runs")
    for name, t in training.items():
        print(f"{name} training consumes {t['tokens_per_rank_s']:,.0f} tokens/s per rank (median step {t['median_step_s']:.3f} s)", flush=True)
    for r in results.values():
        r["x_training"] = {name: round(r["tokens_source_tokens_s"] / t["tokens_per_rank_s"], 1) for name, t in training.items()}
    report = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "pyarrow": pa.__version__, "torch": torch.__version__, "loadavg_at_start": loadavg_start, "loadavg_at_end": os.getloadavg()},
        "setup": {"tokens": args.tokens, "s3_tokens": args.s3_tokens, "seq_len": L, "batch": args.batch, "rounds": args.rounds, "seconds": args.seconds,
                  "units": "tokens/s in one process and thread (seq_len labels per window); ratio = tokens source / plain; "
                           "x_training = tokens source / what one rank of each job consumes (demo, hf_tiny, hf_readme)"},
        "training": training,
        "results": results,
        "bench_wall_s": round(time.perf_counter() - started, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("\n" + table(report))
    print(f"\nwrote {args.out}")


def table(report: dict) -> str:
    """The markdown table of bench/README.md: each read against the plain read and against each job's consumption."""
    names = list(report["training"])
    lines = [f"| source, order | tokens source (tokens/s) | plain read (tokens/s) | ratio | {' | '.join(f'x {n}' for n in names)} |",
             f"|---|---:|---:|---:|{'---:|' * len(names)}"]
    for name, r in report["results"].items():
        xs = " | ".join(f"{round(r['x_training'][n]):,}" for n in names)
        ratio = f"{r['ratio']:.2f}" if r["ratio"] >= 0.1 else f"{r['ratio']:.3f}"
        lines.append(f"| {name} | {r['tokens_source_tokens_s']:,} | {r['plain_tokens_s']:,} | {ratio} | {xs} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
