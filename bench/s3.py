"""S3 data path: s3fs vs pyarrow's S3FileSystem, same bytes, same moto server, same run.

Starts a moto S3 server on 127.0.0.1 (a free port), then, for `--rounds`
rounds, each client in turn (the one going first alternates):

1. sequential write of one `--mb` MB object from 8 MB chunks (the size of the
   staging buffers a data-file write hands on): s3fs `fs.open(path, "wb")`
   (what `storage.fs.Store.write` did for s3://), pyarrow `open_output_stream`;
   timed from the open to the end of the close (the multipart upload complete).
2. ranged reads of one object (written once per round, outside the timing)
   as `storage/reader.py` asks for them: `--ranges` coalesced ranges covering
   it, filled into preallocated buffers: s3fs `cat_ranges` (all ranges
   concurrently) and a copy into the buffers; pyarrow `read_at` on one input
   file, up to `--threads` ranges in flight on a thread pool, and a copy.

Every read is checked against the bytes written (outside the timing). Figures
are bytes / wall time in GB/s (1e9), the median of the rounds (every sample is
in the JSON); `ratio` = pyarrow / s3fs. Alongside, the CPU seconds the
benchmark process (the client, all its threads; not the server) spent per GB:
moto, a Python server, is the bottleneck on a small machine, and the client's
CPU is what a client change saves there. Writes `bench/results/s3.json` and
prints the markdown table for `bench/README.md`. Run with `make bench-s3`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 8 << 20
BUCKET = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int, log: Path) -> subprocess.Popen:
    server = Path(sys.executable).with_name("moto_server")
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto_server did not start: {log.read_text()}") from None
            time.sleep(0.1)


def s3fs_write(fs, path: str, data: memoryview) -> None:
    with fs.open(path, "wb") as f:
        for i in range(0, data.nbytes, CHUNK):
            f.write(data[i : i + CHUNK])


def arrow_write(fs, path: str, data: memoryview) -> None:
    with fs.open_output_stream(path, compression=None) as f:
        for i in range(0, data.nbytes, CHUNK):
            f.write(data[i : i + CHUNK])


def s3fs_read(fs, path: str, ranges: list[tuple[int, int]], out: memoryview, threads: int) -> None:
    chunks = fs.cat_ranges([path] * len(ranges), [s for s, _ in ranges], [s + n for s, n in ranges], on_error="raise")
    for (start, n), chunk in zip(ranges, chunks):
        out[start : start + n] = chunk


def arrow_read(fs, path: str, ranges: list[tuple[int, int]], out: memoryview, threads: int) -> None:
    with fs.open_input_file(path) as f:

        def one(r):
            start, n = r
            out[start : start + n] = f.read_at(n, start)

        with ThreadPoolExecutor(max_workers=min(threads, len(ranges))) as pool:
            list(pool.map(one, ranges))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="object size in MB (MiB)")
    ap.add_argument("--ranges", type=int, default=16, help="coalesced ranges a read asks for (they cover the object)")
    ap.add_argument("--threads", type=int, default=16, help="pyarrow ranges in flight")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/s3.json"))
    args = ap.parse_args()

    import numpy as np
    import pyarrow
    import pyarrow.fs as pafs
    import s3fs

    size = args.mb << 20
    data = memoryview(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)).cast("B")
    span = -(-size // args.ranges)
    ranges = [(s, min(span, size - s)) for s in range(0, size, span)]

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint
    )
    loadavg_start = os.getloadavg()
    t_start = time.perf_counter()
    log = Path(tempfile.mkdtemp(prefix="bench-s3-")) / "moto.log"
    proc = start_moto(port, log)
    try:
        sfs = s3fs.S3FileSystem(skip_instance_cache=True)
        afs = pafs.S3FileSystem(
            access_key="testing", secret_key="testing", region="us-east-1", endpoint_override=f"127.0.0.1:{port}", scheme="http"
        )
        sfs.mkdir(BUCKET)
        clients = {"s3fs": (sfs, s3fs_write, s3fs_read), "pyarrow": (afs, arrow_write, arrow_read)}
        samples: dict[str, dict[str, list[float]]] = {op: {c: [] for c in clients} for op in ("write", "read")}
        cpu: dict[str, dict[str, list[float]]] = {op: {c: [] for c in clients} for op in ("write", "read")}
        out = memoryview(bytearray(size))
        out_np, data_np = np.frombuffer(out, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8)
        for r in range(args.rounds):
            order = list(clients) if r % 2 == 0 else list(reversed(clients))
            for name in order:
                fs, write, _ = clients[name]
                path = f"{BUCKET}/write-{name}-{r}.bin"
                t0, c0 = time.perf_counter(), time.process_time()
                write(fs, path, data)
                samples["write"][name].append(size / (time.perf_counter() - t0) / 1e9)
                cpu["write"][name].append((time.process_time() - c0) / (size / 1e9))
                sfs.invalidate_cache()
                if sfs.info(path)["size"] != size or sfs.cat_file(path, start=size - 4096) != bytes(data[size - 4096 :]):
                    raise RuntimeError(f"{name}: {path} does not hold what was written")
                sfs.rm_file(path)
            path = f"{BUCKET}/read-{r}.bin"
            s3fs_write(sfs, path, data)
            for name in order:
                fs, _, read = clients[name]
                out_np[:] = 0
                t0, c0 = time.perf_counter(), time.process_time()
                read(fs, path, ranges, out, args.threads)
                samples["read"][name].append(size / (time.perf_counter() - t0) / 1e9)
                cpu["read"][name].append((time.process_time() - c0) / (size / 1e9))
                if not np.array_equal(out_np, data_np):
                    raise RuntimeError(f"{name}: ranged read of {path} returned other bytes")
            sfs.rm_file(path)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{op} {c} {v[c][-1]:.3f}" for op, v in samples.items() for c in v), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    results = {}
    for op, per in samples.items():
        med = {c: statistics.median(v) for c, v in per.items()}
        results[op] = {
            "s3fs_gbps": round(med["s3fs"], 4),
            "pyarrow_gbps": round(med["pyarrow"], 4),
            "ratio": round(med["pyarrow"] / med["s3fs"], 3),
            "s3fs_client_cpu_s_per_gb": round(statistics.median(cpu[op]["s3fs"]), 3),
            "pyarrow_client_cpu_s_per_gb": round(statistics.median(cpu[op]["pyarrow"]), 3),
            "s3fs_samples": [round(x, 4) for x in per["s3fs"]],
            "pyarrow_samples": [round(x, 4) for x in per["pyarrow"]],
        }
    report = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "pyarrow": pyarrow.__version__,
            "s3fs": s3fs.__version__,
            "moto": _version("moto"),
            "loadavg_at_start": loadavg_start,
            "loadavg_at_end": os.getloadavg(),
        },
        "setup": {
            "server": "moto_server on 127.0.0.1 (one Python process)",
            "object_mb": args.mb,
            "write_chunk_mb": CHUNK >> 20,
            "ranges": len(ranges),
            "range_mb": span / (1 << 20),
            "pyarrow_read_threads": min(args.threads, len(ranges)),
            "rounds": args.rounds,
            "units": "GB/s (1e9 bytes/s), medians of the rounds; ratio = pyarrow / s3fs; "
            "client_cpu_s_per_gb: CPU seconds of the benchmark process (all its threads, not the server) per GB moved",
        },
        "results": results,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(f"| operation ({args.mb} MB object) | s3fs GB/s | pyarrow GB/s | pyarrow / s3fs | client CPU s/GB s3fs | client CPU s/GB pyarrow |")
    print("|---|---:|---:|---:|---:|---:|")
    labels = {
        "write": f"sequential write ({CHUNK >> 20} MB chunks)",
        "read": f"ranged read ({len(ranges)} x {span / (1 << 20):g} MB)",
    }
    for op, res in results.items():
        print(
            f"| {labels[op]} | {res['s3fs_gbps']:.3f} | {res['pyarrow_gbps']:.3f} | {res['ratio']:.2f} "
            f"| {res['s3fs_client_cpu_s_per_gb']:.2f} | {res['pyarrow_client_cpu_s_per_gb']:.2f} |"
        )
    print(f"\nwrote {args.out} ({report['wall_s']} s)")


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
