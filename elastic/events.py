"""The run's event log: one JSON object per line with a wall-clock timestamp.

The controller is the only writer. Lines are flushed as they are written, so
a crashed run still leaves its history.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class EventLog:
    def __init__(self, path: Path, sinks=()):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", buffering=1)
        self.sinks = list(sinks)  # callables fed every event: progress line, metrics, alert rules
        self.events: list[dict] = []

    def emit(self, event: str, **fields) -> dict:
        record = {"t": fields.pop("t", time.time()), "event": event, **fields}
        self.events.append(record)
        self._file.write(json.dumps(record, default=str) + "\n")
        for sink in self.sinks:
            sink(record)
        return record

    def of(self, event: str) -> list[dict]:
        return [e for e in self.events if e["event"] == event]

    def close(self) -> None:
        self._file.close()


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
