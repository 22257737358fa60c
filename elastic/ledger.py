"""The sample ledger: which sample indices each kept step consumed.

Steps after the checkpoint a recovery resumes from are rolled back (their
updates are gone), so the ledger drops them too. Each step is recorded with
what the global order says it should have read (the controller's sampler,
from the position the generation resumed at); at the end the two are
compared as multisets: nothing missing and nothing duplicated proves the data
position survived every restart and resize.
"""

from __future__ import annotations

from collections import Counter


class SampleLedger:
    def __init__(self):
        self._by_step: dict[int, list[int]] = {}
        self._expected: dict[int, list[int]] = {}

    def record(self, step: int, samples: list[int], expected: list[int]) -> None:
        """The samples the ranks reported for `step`, and the ones the global order assigns it."""
        self._by_step.setdefault(step, []).extend(samples)  # a step counted twice shows as duplicates
        self._expected[step] = list(expected)

    def rollback(self, to_step: int) -> None:
        """Forget steps >= to_step (they will be run again)."""
        for step in [s for s in self._by_step if s >= to_step]:
            del self._by_step[step], self._expected[step]

    def steps(self) -> list[int]:
        return sorted(self._by_step)

    def summary(self, expected: list[int] | None = None) -> dict:
        """Seen against `expected` (default: what the kept steps were assigned), as multisets."""
        seen = Counter(i for samples in self._by_step.values() for i in samples)
        want = Counter(expected if expected is not None else (i for samples in self._expected.values() for i in samples))
        return {
            "expected": sum(want.values()),
            "seen_once": sum(min(n, seen[k]) for k, n in want.items()),
            "duplicated": sum(max(0, n - want[k]) for k, n in seen.items()),
            "missing": sum(max(0, n - seen[k]) for k, n in want.items()),
        }
