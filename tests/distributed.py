"""Run a function on N real gloo ranks (separate processes) and collect what each returns.

The function must be importable (module level) and take `(rank, world, *args)`;
it runs inside an initialised default process group on 127.0.0.1. Return
values travel back as torch-saved files of plain tensors/containers (written
by this harness, read with weights_only=True).
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports on 127.0.0.1: all held at once while chosen (ports chosen one after the other can
    repeat, since each is free again once chosen: a Ray head told one port for two components refuses to start)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _entry(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def run_distributed(fn, world: int, *args) -> list:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; returns the per-rank results in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_entry, args=(world, free_port(), out_dir, fn, args), nprocs=world, start_method="spawn")
        except Exception as exc:
            errors = sorted(Path(out_dir).glob("*.err"))
            detail = errors[0].read_text() if errors else ""
            raise RuntimeError(f"distributed run failed: {exc}\n{detail}") from None
        return [torch.load(Path(out_dir) / f"{r}.pt", weights_only=True) for r in range(world)]
