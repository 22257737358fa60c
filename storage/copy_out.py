"""Write a rank's data file from outside the rank: its node agent reads the live tensors straight out of the rank's memory.

The memory tier snapshots every step. Written by a thread of the rank
itself, the snapshot shares the rank's GIL and its scheduling class with the
training thread, and takes CPU from it whenever the cores are busy; a thread
of the node agent can run on `SCHED_IDLE` (`elastic.sched`), taking only what
no training thread wants, which a thread of the rank cannot (it would hold
the GIL while descheduled). So the rank sends the addresses of its pieces
(`storage.writer.plan_copy`) and the agent copies them with
`process_vm_readv(2)` into the file's map, one system call per batch of
pieces, checksumming each block while it is still in cache: the same bytes,
the same rows and checksums as `storage.writer.write_shards` writes.

The rank must not change those tensors until the copy is answered (its next
optimizer step waits for it). Linux only; the agent is the ranks' ancestor,
which Yama's default `ptrace_scope` (1) allows. Where the call is refused
(`EPERM`, `ENOSYS`: a sandbox, another kernel) `CopyRefused` says so and the
rank writes its snapshots itself again. No torch here: the agent never imports it.
"""

from __future__ import annotations

import ctypes
import errno
import os

from storage.format import COMBINE_IS_CHEAP, crc32, crc32_combine

BLOCK = 1 << 20
"""A piece is copied and checksummed in blocks of this size (still in this core's cache when checksummed); here and
in `storage.writer`."""
RECHECK_MAX = 0 if COMBINE_IS_CHEAP else 64 << 10
"""Pieces smaller than this are checksummed a second time into the file's CRC-32 rather than combined into it
(a combine in Python costs as much as a pass over 64 KiB)."""
_IOV_MAX = 1024


class CopyRefused(OSError):
    """The kernel does not let this process read the rank's memory (not the rank's fault; it writes its own files)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv = None


def _process_vm_readv():
    global _readv
    if _readv is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "process_vm_readv", None)
        if fn is None:
            raise CopyRefused(errno.ENOSYS, "process_vm_readv is not available on this system")
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        _readv = fn
    return _readv


def _chunks(regions: list[tuple[int, int, int]]):
    """(piece index, address, nbytes, file offset) in pieces of at most `BLOCK` bytes, in file order."""
    for i, (address, nbytes, offset) in enumerate(regions):
        for start in range(0, nbytes, BLOCK):
            yield i, address + start, min(BLOCK, nbytes - start), offset + start


def _batches(regions: list[tuple[int, int, int]]):
    """Chunks grouped into batches of at most `BLOCK` bytes and `_IOV_MAX` chunks: one system call each."""
    batch, size = [], 0
    for chunk in _chunks(regions):
        if batch and (size + chunk[2] > BLOCK or len(batch) == _IOV_MAX):
            yield batch
            batch, size = [], 0
        batch.append(chunk)
        size += chunk[2]
    if batch:
        yield batch


def _read_batch(pid: int, batch: list[tuple[int, int, int, int]], base: int) -> None:
    n = len(batch)
    local, remote = (_Iovec * n)(), (_Iovec * n)()
    want = 0
    for j, (_, address, nbytes, offset) in enumerate(batch):
        local[j].iov_base, local[j].iov_len = base + offset, nbytes
        remote[j].iov_base, remote[j].iov_len = address, nbytes
        want += nbytes
    got = _process_vm_readv()(pid, local, n, remote, n, 0)
    if got == want:
        return
    if got < 0:
        code = ctypes.get_errno()
        if code in (errno.EPERM, errno.ENOSYS):
            raise CopyRefused(code, f"cannot read the memory of process {pid}: {os.strerror(code)}")
        raise OSError(code, f"reading the memory of process {pid}: {os.strerror(code)}")
    raise OSError(errno.EFAULT, f"read {got} of {want} bytes of process {pid}'s memory (it changed or ended)")


def fill_from_process(pid: int, regions: list[tuple[int, int, int]], view: memoryview) -> tuple[list[int], int]:
    """Copy the pieces `regions` ((address in process `pid`, nbytes, offset in the file), in file order) into `view`,
    the whole file's writable map, zeroing the padding between them; returns each piece's CRC-32 and the file's."""
    base = ctypes.addressof(ctypes.c_char.from_buffer(view))
    crcs, file_crc, pos = [0] * len(regions), 0, 0
    for batch in _batches(regions):
        _read_batch(pid, batch, base)
        for i, _, nbytes, offset in batch:
            if offset > pos:  # the padding before a piece (its first chunk)
                view[pos:offset] = bytes(offset - pos)
                file_crc = crc32(view[pos:offset], file_crc)
            crcs[i] = crc32(view[offset : offset + nbytes], crcs[i])
            pos = offset + nbytes
            if pos == regions[i][2] + regions[i][1]:  # the piece's last chunk: into the file's checksum
                size = regions[i][1]
                start = regions[i][2]
                file_crc = crc32(view[start:pos], file_crc) if size < RECHECK_MAX else crc32_combine(file_crc, crcs[i], size)
    return crcs, file_crc


def rows_from_heads(heads: list[str], size: int, crcs: list[int], file_crc: int) -> str:
    """A rank's index rows as a JSON array: each row's JSON up to its checksum (`heads`), the checksums, the file's
    size and checksum (`storage.writer.write_shards`' rows, encoded)."""
    tail = f', "file_bytes": {size}, "file_crc32": {file_crc}}}'
    return "[" + ", ".join(f"{head}{crc}{tail}" for head, crc in zip(heads, crcs)) + "]"
