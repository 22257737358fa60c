"""The rendezvous store the controller hosts: a `TCPStore` that listens on one address only.

torch's `TCPStore` server binds every interface whatever host it is given, and
it has no authentication: whoever reaches its port can read and write keys.
So the controller binds the listening socket itself, to the one address the
ranks need (127.0.0.1 in the embedded cluster, the driver node's cluster
address on a real one), and hands it to the store (`master_listen_fd`). On a
cluster, keep that address on the cluster's private network (deploy/README.md).

Every value the controller reads back from the store is untrusted: see
`parse_fault_signal`.
"""

from __future__ import annotations

import json
import math
import socket
from datetime import timedelta

import torch.distributed as dist


def open_store(host: str, timeout_s: float = 60.0) -> dist.TCPStore:
    """A master TCPStore listening on `host` alone, on a free port (`store.port`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
        store = dist.TCPStore(
            host, sock.getsockname()[1], is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(), use_libuv=False,  # the libuv server cannot take a socket it did not open
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store


def parse_fault_signal(raw: bytes, max_step: int) -> tuple[float, int] | None:
    """`(time, step)` from a rank's fault signal (`{"t": seconds, "step": n}`), or None if the value is not one.

    A peer that can reach the store can write anything there: a value that is
    not exactly this shape is reported by the caller, never acted on.
    """
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or set(value) != {"t", "step"}:
        return None
    t, step = value["t"], value["step"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        return None
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= max_step:
        return None
    return float(t), step
