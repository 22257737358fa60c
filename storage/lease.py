"""One user at a time for a checkpoint URI or a run directory: a lease file that its holder keeps renewing.

    <uri>/.lease.json   {"owner": {...}, "token": "...", "ttl_s": 30, "acquired_unix": ..., "renewed_unix": ...}

A job `acquire`s the lease before it writes anything under the URI and renews
it (`start_renewing`) while it lives. A second job finds a live lease and gets
`LeaseHeld`, whose message names the holder (its owner: job, host, pid) and
when it last renewed. A lease not renewed within its holder's `ttl_s` is stale
(its job is gone): the next `acquire` takes it over and says so. Staleness is
judged on the wall clock of the file's `renewed_unix`, so the ttl must exceed
the clock skew between hosts.

Every acquire ends by waiting `SETTLE_S` and reading the lease back: a job
holds it only if its own random token is still there. On local paths (one
host, or a shared POSIX filesystem) a lease is created by an atomic
create-if-absent (a complete file hard-linked to the name), and a stale one is
first moved aside and compared with the file judged stale -- a job that moved
a live lease by mistake puts it back -- so of any number of jobs racing for a
free or stale lease one wins, unless a process stalls longer than `SETTLE_S`
inside those few system calls. Object stores (`s3://`, any fsspec URI) have no
atomic create-if-absent here: the last writer wins and the read-back tells the
others -- best effort, enough to refuse a second job started by mistake. A
holder that let its lease go stale learns that it was taken over at its next
renewal (`LeaseHeld`), which the background renewer reports through `on_lost`.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from storage.fs import Store

LEASE_FILE = ".lease.json"
SETTLE_S = 0.5
"""How long an acquiring job waits before reading its lease back (a racing job's write lands meanwhile)."""
_ATTEMPTS = 5


class LeaseHeld(RuntimeError):
    """Someone else holds the lease; `holder` is their lease record (None when it could not be read)."""

    def __init__(self, message: str, holder: dict | None = None):
        super().__init__(message)
        self.holder = holder


class Lease:
    """The lease on one URI for one owner (a JSON-able dict: job name, ...; `host` and `pid` are added)."""

    def __init__(self, uri: str, owner: dict, *, ttl_s: float = 30.0, storage_options: dict | None = None):
        if not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"Lease: ttl_s must be a positive number of seconds, not {ttl_s!r}")
        self.owner = {**owner, **{k: v for k, v in (("host", socket.gethostname()), ("pid", os.getpid())) if k not in owner}}
        json.dumps(self.owner)  # fails now, not at the first write, if the owner is not JSON-able
        self.ttl_s = float(ttl_s)
        self.store = Store(uri, storage_options)
        self.where = self.store.describe(LEASE_FILE)
        self.token: str | None = None
        """This holder's random token while it holds the lease (set by `acquire`, cleared by `release`)."""
        self.acquired_unix = 0.0
        self.lost: BaseException | None = None
        """Why the background renewer stopped, when it lost the lease or could not renew it within `ttl_s`."""
        self._lock = threading.Lock()  # one lease operation at a time (the renewer thread and the owner's)
        self._stop: threading.Event | None = None
        self._renewer: threading.Thread | None = None

    # -- the lease file ---------------------------------------------------------------------------------------
    def _record(self, now: float) -> bytes:
        return json.dumps(
            {"owner": self.owner, "token": self.token, "ttl_s": self.ttl_s, "acquired_unix": self.acquired_unix, "renewed_unix": now}
        ).encode()

    def _read(self) -> tuple[bytes, dict | None] | None:
        """(raw bytes, parsed record or None when garbled), or None when there is no lease file."""
        try:
            raw = self.store.read(LEASE_FILE)
        except FileNotFoundError:
            return None
        return raw, _parse(raw)

    def _live(self, record: dict | None, now: float) -> bool:
        return record is not None and now - record["renewed_unix"] <= record["ttl_s"]

    def _held(self, record: dict | None, now: float) -> LeaseHeld:
        if record is None:
            return LeaseHeld(f"{self.where} is held by someone else (its lease file does not parse)")
        owner = ", ".join(f"{k}={v}" for k, v in record["owner"].items())
        age = max(0.0, now - record["renewed_unix"])
        return LeaseHeld(
            f"{self.where} is held by {owner} (renewed {age:.1f} s ago, stale after {record['ttl_s']:g} s without "
            "renewal): another job uses this URI; stop that job, or use another URI",
            record,
        )

    def _confirm(self) -> None:
        """After writing the lease: wait for racing jobs' writes to land, then read it back; LeaseHeld if another won."""
        time.sleep(SETTLE_S)
        now = time.time()
        got = self._read()
        record = got[1] if got else None
        if record is None or record["token"] != self.token:
            raise self._held(record, now)

    def _take_away(self, raw: bytes) -> bool:
        """Local files: remove the lease file if it still holds exactly `raw`; True if it did.

        The file is moved aside first (atomic: only one mover gets it), then
        compared; a file that changed meanwhile (renewed, or another job's new
        lease) is put back, over anything created in that instant, whose job
        then fails its read-back.
        """
        aside = f"{LEASE_FILE}.{uuid.uuid4().hex}.old"
        try:
            self.store.rename(LEASE_FILE, aside)
        except FileNotFoundError:
            return False
        try:
            moved = self.store.read(aside)
        except BaseException:
            self.store.rename(aside, LEASE_FILE)
            raise
        if moved == raw:
            self.store.remove(aside)
            return True
        self.store.rename(aside, LEASE_FILE)  # someone else's live lease: back in place
        return False

    # -- what a job calls -------------------------------------------------------------------------------------
    def acquire(self) -> dict | None:
        """Take the lease; LeaseHeld (naming the holder) when a live one exists.

        Returns the record of a stale lease it took over (its owner and when it
        last renewed; `{"garbled": True}` for a file that did not parse), or
        None when the lease was free.
        """
        if self.token is not None:  # held already: acquiring again is a renewal
            self.renew()
            return None
        with self._lock:
            self.store.makedirs()
            try:
                return self._acquire()
            except BaseException:
                self.token = None
                raise

    def _acquire(self) -> dict | None:
        taken = None
        for _ in range(_ATTEMPTS):
            now = time.time()
            self.token, self.acquired_unix = uuid.uuid4().hex, now
            if self.store.create_new(LEASE_FILE, self._record(now)):
                self._confirm()
                return taken
            got = self._read()
            if got is None:
                continue  # released meanwhile
            raw, record = got
            if self._live(record, time.time()):
                raise self._held(record, time.time())
            stale = record if record is not None else {"garbled": True}
            if self.store.local is not None:
                if self._take_away(raw):
                    taken = stale
                continue
            self.store.write_atomic(LEASE_FILE, self._record(now))
            self._confirm()
            return stale
        raise LeaseHeld(f"{self.where}: could not take the lease after {_ATTEMPTS} attempts (other jobs racing for it)")

    def renew(self) -> None:
        """Extend the lease by `ttl_s`; LeaseHeld if someone else holds it now (it went stale and was taken over)."""
        with self._lock:
            if self.token is None:
                raise RuntimeError(f"{self.where}: renew of a lease not acquired")
            now = time.time()
            got = self._read()
            if got is None:  # removed by hand: nobody holds it, so this holder takes it again
                if not self.store.create_new(LEASE_FILE, self._record(now)):
                    got = self._read()
                    raise self._held(got[1] if got else None, now)
                self._confirm()
                return
            record = got[1]
            if record is None or record["token"] != self.token:
                raise self._held(record, now)
            self.store.write_atomic(LEASE_FILE, self._record(now))

    def release(self) -> bool:
        """Stop renewing and remove the lease if it is this holder's; LeaseHeld if someone else's. False if there was none."""
        self.stop()
        with self._lock:
            got = self._read()
            if got is None:
                self.token = None
                return False
            raw, record = got
            if self.token is None or record is None or record["token"] != self.token:
                raise self._held(record, time.time())
            if self.store.local is not None:
                if not self._take_away(raw):
                    got = self._read()
                    raise self._held(got[1] if got else None, time.time())
            else:
                self.store.remove(LEASE_FILE)
            self.token = None
            return True

    def start_renewing(self, every_s: float | None = None, on_lost: Callable[[BaseException], None] | None = None) -> None:
        """Renew every `every_s` (default ttl/3) on a daemon thread until `stop` or `release`.

        A renewal that fails with an I/O error is retried at the next tick; the
        lease counts as lost when another holder has it, or when no renewal
        succeeded for `ttl_s`. Then the thread stops, sets `lost` and calls
        `on_lost(error)`: the job must stop using the URI.
        """
        every = self.ttl_s / 3 if every_s is None else every_s
        if not 0 < every < self.ttl_s:
            raise ValueError(f"start_renewing: every_s must be between 0 and ttl_s ({self.ttl_s:g}), not {every_s!r}")
        self.stop()
        stop = self._stop = threading.Event()

        def renew_until_stopped() -> None:
            last_ok = time.monotonic()
            while not stop.wait(every):
                try:
                    self.renew()
                    last_ok = time.monotonic()
                    continue
                except LeaseHeld as exc:
                    error: BaseException = exc
                except Exception as exc:  # noqa: BLE001 - an I/O hiccup: retried until the lease would be stale
                    if time.monotonic() - last_ok <= self.ttl_s:
                        continue
                    error = exc
                self.lost = error
                if on_lost is not None:
                    on_lost(error)
                return

        self._renewer = threading.Thread(target=renew_until_stopped, name="lease-renewer", daemon=True)
        self._renewer.start()

    def stop(self) -> None:
        """Stop the background renewer (the lease stays until it goes stale or is released)."""
        if self._stop is not None:
            self._stop.set()
            if self._renewer is not threading.current_thread():
                self._renewer.join()
            self._stop = self._renewer = None

    def __enter__(self) -> Lease:
        self.acquire()
        self.start_renewing()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _parse(raw: bytes) -> dict | None:
    """A lease record, or None for anything else (garbled or hand-written files must not crash a job)."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    ok = (
        isinstance(record, dict)
        and isinstance(record.get("owner"), dict)
        and isinstance(record.get("token"), str)
        and all(_finite(record.get(k)) for k in ("ttl_s", "renewed_unix"))
        and record["ttl_s"] > 0
    )
    return record if ok else None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
