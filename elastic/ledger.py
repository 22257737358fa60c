"""The sample ledger: which sample indices each kept step consumed.

Steps after the checkpoint a recovery resumes from are rolled back (their
updates are gone), so the ledger drops them too. At the end it is compared,
as a multiset, with the samples the global order says the run should have
seen: nothing missing and nothing duplicated proves the data position
survived every restart and resize.
"""

from __future__ import annotations

from collections import Counter


class SampleLedger:
    def __init__(self):
        self._by_step: dict[int, list[int]] = {}

    def record(self, step: int, samples: list[int]) -> None:
        self._by_step.setdefault(step, []).extend(samples)

    def rollback(self, to_step: int) -> None:
        """Forget steps >= to_step (they will be run again)."""
        for step in [s for s in self._by_step if s >= to_step]:
            del self._by_step[step]

    def steps(self) -> list[int]:
        return sorted(self._by_step)

    def summary(self, expected: list[int]) -> dict:
        seen = Counter(i for samples in self._by_step.values() for i in samples)
        want = Counter(expected)
        return {
            "expected": sum(want.values()),
            "seen_once": sum(min(n, seen[k]) for k, n in want.items()),
            "duplicated": sum(max(0, n - want[k]) for k, n in seen.items()),
            "missing": sum(max(0, n - seen[k]) for k, n in want.items()),
        }
