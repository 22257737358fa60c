"""The memory tier's replication link: a node agent streams its ranks' snapshot files straight to its peer node's agent.

A Ray actor call with the file's bytes as an argument costs three copies
and the object store's machinery (the bytes go through plasma on both
nodes); measured on the strategies benchmark's 4-rank job, replicating every
step that way took a quarter of a core from the ranks' training. Over one
TCP connection per peer the sender hands the file to the kernel
(`socket.sendfile`) and the receiver reads it straight into a map of its
file in its node's memory directory (`storage.fs.FileMaps`, kept from one
replica to the next): one copy, from the kernel into the file; no
serialisation, no object store.

Each agent that replicates listens on its node's address (127.0.0.1 on the
embedded cluster); a connection must open with the job's secret (handed to
the agents by the driver, over Ray), so nothing else can write into a node's
memory. Frames on a connection, one at a time:

    -> 8-byte length, JSON header {step, rank, generation, body_bytes, nbytes}, then body_bytes of the file's
       rows file as it is stored (`elastic.memory.rows_body`), then nbytes of the file (nbytes null: no file)
    <- 8-byte length, JSON {"ok": true} or {"ok": false, "error": "..."}

The receiver drops that rank's older replicas, stores the file and then its
rows (the replica is then complete, as if its rank had written it there). The
rows travel as bytes, never parsed: encoding and decoding a few hundred rows
on both ends cost as much CPU as the file's trip through the kernel. Both
ends run on SCHED_IDLE (`elastic.sched.idle_this_thread`): the copy fills the
moments a core has nothing else to do, and a rank waits for its replica only
before its next gradient-norm all-reduce. A rank that has to wait has both
ends lifted to SCHED_BATCH for a while (`elastic.sched.Background.hurry` on
the sender's node, `ReplicaServer.hurry` on the receiver's).
"""

from __future__ import annotations

import hmac
import json
import socket
import struct
import threading
from pathlib import Path

from elastic.memory import NodeMemory
from elastic.sched import Lift
from storage.fs import FileMaps

SECRET_BYTES = 32
_LEN = struct.Struct("!Q")
_CHUNK = 1 << 20
_MAPS_KEPT = 64
"""Maps a connection keeps (`storage.fs.FileMaps`; those of files gone are closed): two files per rank of the sending
node, for up to 32 ranks a node."""
_MAX_HEADER = 16 << 20  # a header is a few index rows per piece; anything larger is not a peer's


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the replication link")
        got += k
    return bytes(buf)


def _discard(sock: socket.socket, n: int) -> None:
    """Read `n` bytes off the link and drop them."""
    scratch = memoryview(bytearray(min(n, _CHUNK)))
    while n:
        k = sock.recv_into(scratch, min(n, _CHUNK))
        if k == 0:
            raise ConnectionError("the peer closed the replication link")
        n -= k


def _send_msg(sock: socket.socket, obj: dict, tail: bytes = b"") -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data + tail)


def _recv_msg(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > _MAX_HEADER:
        raise ConnectionError(f"a replication message of {n} bytes is not a peer's")
    return json.loads(_recv_exact(sock, n))


class ReplicaServer:
    """Takes the peer agents' replicas into this node's memory directory; one thread per connection."""

    def __init__(self, memory: NodeMemory, host: str, secret: bytes):
        self._memory, self._secret = memory, secret
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self._tids: set[int] = set()  # the connections' threads
        self._lift = Lift()
        threading.Thread(target=self._accept, name="replica-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="replica-in", daemon=True).start()

    def hurry(self) -> None:
        """A rank waits for a replica from this node's peer: lift the receiving threads for a while (`elastic.sched.Lift`)."""
        self._lift.hurry(list(self._tids))

    def _serve(self, conn: socket.socket) -> None:
        tid = threading.get_native_id()
        self._tids.add(tid)
        maps = FileMaps(keep=_MAPS_KEPT)
        with conn:
            try:
                if not hmac.compare_digest(_recv_exact(conn, SECRET_BYTES), self._secret):
                    return
                while True:
                    self._lift.settle()  # as the sender's; a lift (`hurry`) ends
                    header = _recv_msg(conn)
                    try:
                        self._take(conn, header, maps)
                        _send_msg(conn, {"ok": True})
                    except OSError as exc:  # this node could not store it (memory full): the sender learns why
                        _send_msg(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            except (OSError, ValueError, ConnectionError):
                return  # the peer went, or sent something that is not a frame: its next send reconnects
            finally:
                maps.close()
                self._tids.discard(tid)

    def _take(self, conn: socket.socket, header: dict, maps: FileMaps) -> None:
        step, rank, generation = int(header["step"]), int(header["rank"]), int(header["generation"])
        if not 0 <= int(header["body_bytes"]) <= _MAX_HEADER:
            raise ConnectionError(f"a rows file of {header['body_bytes']} bytes is not a peer's")
        body = _recv_exact(conn, int(header["body_bytes"]))
        nbytes = None if header["nbytes"] is None else int(header["nbytes"])
        left = nbytes or 0

        def fill(view: memoryview) -> None:  # the file, off the link, straight into its map
            nonlocal left
            while left:
                n = conn.recv_into(view[len(view) - left:], left)
                if not n:
                    raise ConnectionError("the peer closed the replication link mid-file")
                left -= n

        try:
            self._memory.keep_two(rank, generation, step)  # first: the file it drops becomes this one (NodeMemory.keep_two)
            self._memory.put_file(step, rank, generation, nbytes, fill, body, maps)
        finally:
            _discard(conn, left)  # a write that failed before its end (memory full): the rest of the file, to stay in step

    def close(self) -> None:
        self._sock.close()


class ReplicaClient:
    """Sends this node's finished snapshot files to the peer's `ReplicaServer`, one at a time, over one connection."""

    def __init__(self, address: tuple[str, int], secret: bytes, timeout_s: float):
        self.address, self._secret, self._timeout_s = tuple(address), secret, timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def send(self, path: Path | None, step: int, rank: int, generation: int, body: bytes) -> None:
        """Replicate one file (None: a rank with nothing to store) and its rows file's `body`; raises if the peer
        did not take it."""
        with self._lock:
            try:
                self._send(path, {"step": step, "rank": rank, "generation": generation, "body_bytes": len(body)}, body)
            except BaseException:
                self._close()  # a link that failed mid-frame is out of step: the next send opens a new one
                raise

    def _send(self, path: Path | None, header: dict, body: bytes) -> None:
        if self._sock is None:
            self._sock = socket.create_connection(self.address, timeout=self._timeout_s)
            self._sock.sendall(self._secret)
        sock = self._sock
        if path is None:
            _send_msg(sock, {**header, "nbytes": None}, body)
        else:
            with open(path, "rb") as f:
                _send_msg(sock, {**header, "nbytes": f.seek(0, 2)}, body)
                f.seek(0)
                sock.sendfile(f)
        answer = _recv_msg(sock)
        if not answer.get("ok"):
            raise OSError(f"the peer at {self.address[0]}:{self.address[1]} could not store the replica: {answer.get('error')}")

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()

