"""The memory tier's node side: snapshots of the training state in node memory, in the checkpoint format.

Every rank writes its pieces of a memory step with `storage.write_shards`
into its node's memory directory (a RAM-backed filesystem, `/dev/shm` by
default), then its index rows next to them; the rows file is that rank's
commit of the step (a data file without one is a write that did not finish).
The node agent replicates each finished file to one other node. After a
failure it writes the restored step's index and manifest with
`storage.commit`, and the new ranks load it with
`storage.load_training_state`, as from any checkpoint: the same pieces in
global coordinates, the same checksums, any layout. Of the files that
survive on other nodes, the agent fetches only the byte ranges its ranks
read (into `hollow` stand-ins), never the whole step.

On disk, below the node's directory (`<root>/<node id>/<job>`):

    step_NNNNNNNN/data/gGGGGGG-rank_RRRRR.bin    a rank's pieces (its own, or a replica of another node's rank)
    step_NNNNNNNN/rows/gGGGGGG-rank_RRRRR.json   its index rows: the file is complete
    step_NNNNNNNN/index.arrow, manifest.json     once staged for a restore (with hollow stand-ins, without rows,
                                                 for the files that are on other nodes)
    spare/data/gGGGGGG-rank_RRRRR.bin            a file dropped below the committed step, for its rank's next write

What a node holds dies with the node: nothing outside the node reads its
directory, only its agent does (on a simulated node of the embedded cluster
too, where `elastic.cluster` deletes the directory when it removes the node).

A job whose agents die without their shutdown (the driver SIGKILLed, an OOM
kill) must not hold a node's RAM until the machine reboots: each agent holds
an exclusive `flock` on `<root>/<node id>/<job>.lock` (`NodeMemory.claim`),
which the kernel releases however the agent ends, and every agent that
starts on a machine removes the job directories whose lock nobody holds
(`sweep_abandoned`).

Retention keeps, per rank, the newest step whose snapshot is complete and the
one being written (`keep_two`): a rank starts writing step s+k only after
every rank has finished step s (it waits for its own snapshot before the
gradient-norm all-reduce that every rank joins), so step s is always whole
somewhere. A node thus holds at most its ranks' state x 2, plus its ring
predecessor's x 2 as replicas. A file dropped below the committed step waits
in `spare/` (without rows: it restores nothing) for its rank's next write,
which overwrites it in place: that file is the one being written next.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from elastic.messages import CopyOut
from storage.copy_out import fill_from_process, rows_from_heads
from storage.format import CheckpointError, crc32, data_file, data_file_generation, parse_step_dir, step_dir
from storage.fs import FileMaps, Store, _pwrite_all

_ROWS = re.compile(r"g(?P<generation>[0-9]{6,})-rank_(?P<rank>[0-9]{5,})\.json")
CLAIM_TIMEOUT_S = 30.0
"""How long an agent waits for the lock of its job's directory on its node (`NodeMemory.claim`): an earlier agent of
the job there that was killed may still be exiting."""
_CLAIM_TRIES = 20  # `claim`'s tries in a row that find a directory gone before it takes the path for one that cannot be made
SPARE = "spare"  # data files set aside below the committed step, each for its rank's next write (NodeMemory.drop_below)
_READ_BLOCK = 8 << 20


class SnapshotFailed(RuntimeError):
    """A memory snapshot that failed elsewhere (the agent's copy out of the rank), its error already described."""


def memory_root(memory_dir: str) -> Path:
    """Where a node keeps the memory tiers of its jobs: `memory_dir`, else /dev/shm (RAM), else the temporary directory."""
    if memory_dir:
        base = Path(memory_dir)
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = Path("/dev/shm")
    else:
        base = Path(tempfile.gettempdir())
    return base / "elastic-memory"


def rows_file(rank: int, generation: int) -> str:
    return "rows/" + data_file(rank, generation).removeprefix("data/").removesuffix(".bin") + ".json"


def rows_body(rows: list[dict] | str, records: Iterable[dict] = ()) -> bytes:
    """A rows file: a data file's index rows (or their JSON array, `storage.rows_json`) and the step records it carries."""
    encoded = rows if isinstance(rows, str) else json.dumps(rows)
    return f'{{"rows": {encoded}, "records": {json.dumps(list(records))}}}'.encode()


def owner_lock(job_dir: Path) -> Path:
    """The file whose `flock` marks a job's directory on a node as held by a live agent (next to it, not in it:
    removing what the directory holds never removes the mark)."""
    return job_dir.with_name(job_dir.name + ".lock")


def free_lock(lock: Path) -> int | None:
    """A descriptor that holds `lock` exclusively, where no live process holds it (its agent is gone); else None."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return None  # gone meanwhile, or not ours
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None  # a live agent holds it
    return fd


def sweep_abandoned(root: Path) -> list[Path]:
    """Remove the job directories under `root` (`<root>/<node id>/<job>`) whose agent is gone: their lock file is
    held by no process. Returns what it removed.

    A directory without a lock file is left alone (an agent takes its lock
    before it makes the directory); so is one that this process may not
    lock or remove (another user's). The lock is held while the directory
    goes, so an agent of the same job that claims it meanwhile waits, then
    claims a new one.
    """
    removed = []
    for lock in sorted(root.glob("*/*.lock")):
        if (fd := free_lock(lock)) is not None:
            memory = NodeMemory(lock.with_suffix(""))
            memory._owner = fd
            memory.destroy()
            if not memory.path.exists():
                removed.append(memory.path)
    return removed


class NodeMemory:
    """One job's memory-tier files on one node."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.uri = str(self.path)
        self.store = Store(self.uri)
        self._owner: int | None = None  # the descriptor that holds this directory's lock (`claim`)

    def claim(self, timeout_s: float = CLAIM_TIMEOUT_S) -> None:
        """Hold this directory's lock for as long as this process (the node agent) lives, or until `destroy`: while
        it is held, no `sweep_abandoned` removes the directory.

        Waits up to `timeout_s` for an earlier agent of the job on this node
        that was killed and is still exiting; raises if it holds on longer,
        and at once where the directory cannot be made (`_unusable`).
        """
        lock, deadline = owner_lock(self.path), time.monotonic() + timeout_s
        vanished = 0  # tries in a row that found a directory gone
        while self._owner is None:
            try:
                lock.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            except FileNotFoundError as exc:
                # A sweep removed the node's directory between the two; a path that cannot be made fails every time.
                vanished += 1
                if vanished > _CLAIM_TRIES:
                    raise self._unusable(exc) from None
                time.sleep(0.01)
                continue
            except OSError as exc:  # not a directory, not writable, read-only
                raise self._unusable(exc) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the memory directory {self.path} is held by another live process (pid {holder or '?'})") from None
                time.sleep(0.05)
                continue
            try:
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                    self._owner = fd
                    continue
            except FileNotFoundError:
                pass
            os.close(fd)  # a sweep removed the file we locked (its directory was abandoned): lock a new one

    def _unusable(self, exc: OSError) -> OSError:
        """The memory directory cannot be made or written: the error names the setting and the directory it gave
        (`<root>`, where the node's and job's directories would go), alike on every node."""
        return type(exc)(exc.errno, f"checkpoint.memory_dir: cannot make a directory in {self.path.parent.parent}: {exc.strerror}")

    # -- a rank's writes -------------------------------------------------------------
    def describe_failure(self, exc: BaseException) -> str:
        """A failed snapshot's error; for a full memory directory, with its size and what it must hold."""
        if isinstance(exc, SnapshotFailed):
            return str(exc)
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            root = self.path.parent.parent
            with contextlib.suppress(OSError):
                st = os.statvfs(root)
                text += (f"; the memory directory {root} ({st.f_blocks * st.f_frsize / 2**20:.1f} MiB, "
                         f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free) is too small: a node holds up to 2 x its "
                         "ranks' snapshots and 2 x those it keeps for another node; give checkpoint.memory_dir more room "
                         "or set checkpoint.memory: false")
        return text

    def finish(self, step: int, rank: int, generation: int, rows: list[dict] | str, records: list[dict] = ()) -> None:
        """Mark `rank`'s data file of `step` complete by writing its rows (or their JSON, `storage.rows_json`) next to
        it (atomically), with the rank's newest step records: the controller's copy of them may die with the node
        (see `step_records`)."""
        self._publish_rows(step, rank, generation, rows_body(rows, records))

    def copy_in(self, pid: int, message: CopyOut, heads: list[str], maps: FileMaps) -> None:
        """Write a rank's snapshot out of the memory of its process `pid` (`storage.copy_out`), as the rank would write
        it itself: drop its older files, fill its file through `maps`, mark it complete. `heads`: its rows' (the
        message's, or those of an earlier message). Raises `storage.copy_out.CopyRefused` where the kernel refuses."""
        step, rank, generation = message.step, message.rank, message.generation
        self.keep_two(rank, generation, step, reuse=message.reuse)
        crcs, file_crc = [], 0
        if message.size:
            def fill(view: memoryview) -> None:
                nonlocal crcs, file_crc
                crcs, file_crc = fill_from_process(pid, message.regions, view)

            self.store.fill_mapped(f"{step_dir(step)}/{data_file(rank, generation)}", message.size, fill, maps)
        self.finish(step, rank, generation, rows_from_heads(heads, message.size, crcs, file_crc) if message.size else [],
                    message.records)

    def _publish_rows(self, step: int, rank: int, generation: int, body: bytes) -> None:
        self.store.write_atomic(f"{step_dir(step)}/{rows_file(rank, generation)}", body, durable=False)

    def keep_two(self, rank: int, generation: int, writing: int, reuse: bool = True) -> None:
        """Before `rank` writes step `writing` (or its replica of it arrives): drop its older files but its newest complete one.

        Never a newer step's: a replica can arrive after newer ones did. The
        first dropped data file becomes the file of `writing` (renamed, without
        its rows: not complete), which the write then overwrites in place: on a
        RAM-backed filesystem a new file costs its pages' allocation and zeroing
        on top of the copy, and as much again to free the old one. `reuse`
        False where something may still read the dropped file (its replica's
        send timed out, and may still be under way: a send reads the file it opened).
        The file `drop_below` set aside for the rank (`spare/`) is taken first.
        """
        mine = data_file(rank, generation)
        steps = sorted(s for (_, s), ranks in self._complete(generation).items() if rank in ranks and s < writing)
        spare, target = self._spare(rank, generation), self.path / step_dir(writing) / mine
        if reuse:
            reused = self._move_data(spare, target)
        else:
            spare.unlink(missing_ok=True)  # nothing is reused: the node keeps two files a rank
            reused = True
        for step in self.steps():
            if step < writing and step not in steps[-1:]:
                reused = reused or self._move_data(self.path / step_dir(step) / mine, target, step, rows_file(rank, generation))
                self._remove_file(step, mine, rank, generation)  # what was not reused
                self._remove_if_empty(step)

    # -- what the node holds ------------------------------------------------------------
    def steps(self) -> list[int]:
        try:
            names = [p.name for p in self.path.iterdir()]
        except FileNotFoundError:
            return []
        return sorted(s for s in map(parse_step_dir, names) if s is not None)

    def _complete(self, generation: int | None, only_step: int | None = None) -> dict[tuple[int, int], dict[int, Path]]:
        """{(generation, step): {rank: its rows file}} of the complete files here (of one generation, or all; of one
        step, or all)."""
        out: dict[tuple[int, int], dict[int, Path]] = {}
        for step in self.steps() if only_step is None else [only_step]:
            try:  # the agent may drop the step between the listing and this (drop_below)
                names = list((self.path / step_dir(step) / "rows").iterdir())
            except (FileNotFoundError, NotADirectoryError):
                continue
            for p in names:
                m = _ROWS.fullmatch(p.name)
                if m and (generation is None or int(m["generation"]) == generation):
                    out.setdefault((int(m["generation"]), step), {})[int(m["rank"])] = p
        return out

    def inventory(self, generation: int | None = None) -> dict[tuple[int, int], dict[int, list[dict]]]:
        """{(generation, step): {rank: index rows}} of every complete file held here (own ranks' and replicas)."""
        return {key: {rank: body["rows"] for rank, body in ranks.items()} for key, ranks in self._bodies(generation).items()}

    def step_records(self, generation: int, step: int) -> dict[int, list[dict]]:
        """{rank: its step records} carried by the complete files of `step` held here.

        A rank's step records reach the controller in batches, through its
        node's agent; those of its last few steps die with its node. Each
        snapshot carries the rank's newest records (`elastic.train.MEMORY_RECORDS`),
        so a restore to a step whose records the controller lacks can fill them in.
        """
        return {rank: body["records"] for rank, body in self._bodies(generation, step).get((generation, step), {}).items()}

    def _bodies(self, generation: int | None, step: int | None = None) -> dict[tuple[int, int], dict[int, dict]]:
        """The parsed rows files ({"rows", "records"}) of the complete files held here, of one generation and step or all."""
        out: dict[tuple[int, int], dict[int, dict]] = {}
        for key, ranks in self._complete(generation, step).items():
            for rank, p in ranks.items():
                try:
                    out.setdefault(key, {})[rank] = json.loads(p.read_bytes())
                except (OSError, ValueError):
                    continue  # unreadable: as if it were not here
        return out

    def nbytes(self) -> int:
        """The memory the files here take (a `hollow` stand-in only its written parts)."""
        total = 0
        for root, _, files in os.walk(self.path):
            for name in files:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                total += min(st.st_size, st.st_blocks * 512)
        return total

    # -- replicas and restores ------------------------------------------------------------
    def read(self, step: int, rel: str) -> bytes:
        return self.store.read(f"{step_dir(step)}/{rel}")

    def put_file(self, step: int, rank: int, generation: int, nbytes: int | None, fill: Callable[[memoryview], None],
                 body: bytes, maps: FileMaps) -> None:
        """Hold a replica of another node's file, `nbytes` that `fill(view)` writes into its map (None: its rank had
        nothing to store), then its rows file's `body` as it was there (`rows_body`): the replica is then complete,
        as if its rank had written it here. `maps` keeps the maps from one replica to the next (`keep_two` hands
        each rank's dropped file to its next replica)."""
        if nbytes is not None:
            self.store.fill_mapped(f"{step_dir(step)}/{data_file(rank, generation)}", nbytes, fill, maps)
        self._publish_rows(step, rank, generation, body)

    def read_ranges(self, step: int, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Byte ranges [start, end) of a data file held here: what another node's restoring ranks read of it."""
        buffers = [bytearray(end - start) for start, end in ranges]
        got = self.store.read_into(f"{step_dir(step)}/{rel}", [(start, [buf]) for (start, _), buf in zip(ranges, buffers)])
        if got != [len(buf) for buf in buffers]:
            raise CheckpointError(f"{self.store.describe(step_dir(step) + '/' + rel)} ends before the ranges asked for")
        return [bytes(buf) for buf in buffers]

    def hollow(self, step: int, rel: str, nbytes: int) -> None:
        """Stand in for another node's data file of a step staged for a restore: its size, all of it a hole (no memory),
        until `put_ranges` writes what this node's ranks read of it. It gets no rows file, so nothing takes it for a
        whole snapshot (`inventory`, a restore's choice of holders); retention drops it with its step."""
        path = self.path / step_dir(step) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(nbytes)

    def put_ranges(self, step: int, rel: str, parts: list[tuple[int, bytes]]) -> None:
        """Write parts of another node's data file ((offset, bytes)) into its `hollow` stand-in."""
        fd = os.open(self.path / step_dir(step) / rel, os.O_WRONLY)
        try:
            for offset, data in parts:
                _pwrite_all(fd, memoryview(data), offset)
        finally:
            os.close(fd)

    def complete_ranks(self, generation: int, step: int) -> set[int]:
        """The ranks whose files of `step` (of `generation`) are here whole."""
        return set(self._complete(generation, step).get((generation, step), {}))

    def rows_body(self, step: int, rank: int, generation: int) -> bytes:
        """The rows file of `rank`'s file of `step` as stored (what a replica carries)."""
        return self.read(step, rows_file(rank, generation))

    def data_path(self, step: int, rank: int, generation: int) -> Path:
        """Where `rank`'s data file of `step` is (a rank with nothing to store writes none)."""
        return self.path / step_dir(step) / data_file(rank, generation)

    def file_path(self, step: int, rows: list[dict]) -> Path | None:
        """The data file that `rows` index (None: a rank with nothing to store wrote none)."""
        return self.path / step_dir(step) / rows[0]["file"] if rows else None

    def verify(self, step: int, rank: int, rows: list[dict]) -> str | None:
        """Why `rank`'s file of `step` does not match its rows (size, CRC-32 of the whole file); None when it does."""
        if not rows:
            return None  # a rank with nothing to store wrote no data file
        rel = rows[0]["file"]
        where = self.store.describe(f"{step_dir(step)}/{rel}")
        try:
            data = self.read(step, rel)
        except (OSError, CheckpointError) as exc:
            return f"{where}: {exc}"
        want_bytes, want_crc = rows[0]["file_bytes"], rows[0]["file_crc32"]
        if len(data) != want_bytes:
            return f"{where} has {len(data)} bytes, its rows say {want_bytes}"
        crc = 0
        view = memoryview(data)
        for i in range(0, len(view), _READ_BLOCK):
            crc = crc32(view[i : i + _READ_BLOCK], crc)
        if crc != want_crc:
            return f"{where}: CRC-32 mismatch (the snapshot is corrupt)"
        return None

    def corrupt(self, seed: int) -> int:
        """Flip one byte of every complete data file held here (fault injection: `corrupt:where=memory`); returns how many."""
        rng = random.Random(seed)
        flipped = 0
        for (_, step), ranks in self.inventory().items():
            for rows in ranks.values():
                if not rows:
                    continue
                path = self.path / step_dir(step) / rows[0]["file"]
                with open(path, "r+b") as f:
                    f.seek(rng.randrange(rows[0]["file_bytes"]))
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0xFF]))
                flipped += 1
        return flipped

    def drop_below(self, generation: int, step: int) -> None:
        """Forget every snapshot older than `step` of `generation`, and every one of an earlier generation.

        (`generation`, `step`) is committed, or what the running generation
        was restored from: nothing before it can be restored any more. A
        data file of `generation` is set aside for its rank's next write
        (`keep_two`) rather than removed: with a snapshot every step, the
        commit usually drops the file the next write would have reused, and a
        new file costs the allocation and zeroing of its pages (and their
        faults, written through a map) on top of the copy. Spares of earlier
        generations go.
        """
        for key, ranks in self._complete(None).items():
            if key < (generation, step):
                for rank in ranks:
                    rel = data_file(rank, key[0])
                    kept = key[0] == generation and self._move_data(
                        self.path / step_dir(key[1]) / rel, self._spare(rank, generation), key[1], rows_file(rank, generation))
                    if not kept:
                        self._remove_file(key[1], rel, rank, key[0])
        for old in self._spares():
            if data_file_generation(f"data/{old.name}") != generation:
                old.unlink(missing_ok=True)
        for s in self.steps():
            if s < step:  # nobody writes below a committed step: what is left there (unfinished writes, empty dirs) goes
                self.store.remove_tree(step_dir(s))

    def destroy(self) -> None:
        """Remove this job's files on the node, its lock unless another live process holds it, and the node's
        directory if no other job has files there."""
        lock = owner_lock(self.path)
        if self._owner is None:
            self._owner = free_lock(lock)  # a killed agent's (the driver removes what it left)
        shutil.rmtree(self.path, ignore_errors=True)
        if self._owner is not None:
            if not self.path.exists():
                lock.unlink(missing_ok=True)
            os.close(self._owner)
            self._owner = None
        try:
            self.path.parent.rmdir()
        except OSError:
            pass  # another job's files are there (or it is gone already)

    def _remove_file(self, step: int, rel: str, rank: int, generation: int) -> None:
        """Remove one file and its rows (the rows first: never a complete-looking file without its data)."""
        for name in (rows_file(rank, generation), rel):
            try:
                self.store.remove(f"{step_dir(step)}/{name}")
            except FileNotFoundError:
                pass

    def _remove_if_empty(self, step: int) -> None:
        """Remove a step's directory once no file is left in it.

        `drop_below` removes what is below the committed step; this keeps a
        job whose memory steps stop committing (its replicas refused or late)
        from piling up empty directories, which every `keep_two` would walk
        (measured: 8 ms of CPU a replica at first, 80 ms after 600 steps). A
        late replica of that step that made its directory just before the
        removal fails to store and is reported like any refused replica.
        """
        path = self.path / step_dir(step)
        for sub in (path / "data", path / "rows", path):
            try:
                sub.rmdir()
            except OSError:
                pass  # not empty (or gone): a file is still there

    def _spare(self, rank: int, generation: int) -> Path:
        return self.path / SPARE / data_file(rank, generation)

    def _spares(self) -> list[Path]:
        try:
            return list((self.path / SPARE / "data").iterdir())
        except FileNotFoundError:
            return []

    def _move_data(self, source: Path, target: Path, step: int = 0, rows: str = "") -> bool:
        """Move a data file to `target`, to be overwritten there (its rows file `rows` of `step`, where given, removed
        first: a moved file is never complete); False when it is gone, or `target` has one already (an earlier
        attempt's: overwritten as it is)."""
        if target.exists() or not source.exists():
            return False
        if rows:
            self.store.remove(f"{step_dir(step)}/{rows}")
        try:
            os.rename(source, target)
        except FileNotFoundError:  # the source is gone, or the target's directory is not there yet
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.rename(source, target)
            except FileNotFoundError:
                return False
        return True
