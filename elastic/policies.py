"""Injected policies: pure objects that look at the situation and return a decision.

The controller asks; it never decides these things itself. Tests drive the
policies (and the controller) one step at a time without Ray.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from elastic.config import JobConfig
from elastic.layout import Layout, LayoutError


@dataclass(frozen=True)
class Failure:
    kind: str  # rank_died, node_died, hang, worker_error, start_failed
    rank: int | None
    node: str | None
    culprit: int | None
    step: int
    detail: str = ""
    cause: str = ""
    """What failed, without where, where the same cause fails the same way each time: the errors a start's calls
    raised (`elastic.worker_group.StartError.cause`); "" for anything that may not happen again."""


@dataclass(frozen=True)
class FailureDecision:
    retry: bool
    reason: str
    exclude_node: str | None = None


class FailurePolicy:
    """Retry up to `max_failures`; exclude a node that was the culprit `exclude_after` times; give up at once on a
    failure with the same cause as the one before it (a start that fails on a setting no node can use): one retry
    covers what was passing, more would only repeat it."""

    def __init__(self, max_failures: int, exclude_after: int = 2):
        self.max_failures = max_failures
        self.exclude_after = exclude_after
        self.history: list[Failure] = []

    def decide(self, failure: Failure) -> FailureDecision:
        previous = self.history[-1] if self.history else None
        self.history.append(failure)
        if failure.cause and previous is not None and previous.cause == failure.cause:
            return FailureDecision(False, f"{failure.kind} twice in a row with the same error, which a retry would repeat: {failure.cause}")
        if len(self.history) > self.max_failures:
            return FailureDecision(False, f"{len(self.history)} failures exceed fault.max_failures={self.max_failures}")
        exclude = None
        if failure.node and failure.kind in ("hang", "worker_error"):
            blamed = Counter(f.node for f in self.history if f.node and f.kind in ("hang", "worker_error"))
            if blamed[failure.node] >= self.exclude_after:
                exclude = failure.node
        reason = f"failure {len(self.history)}/{self.max_failures}: {failure.kind}"
        return FailureDecision(True, reason + (f"; excluding node {exclude}" if exclude else ""), exclude)


@dataclass(frozen=True)
class ScalingDecision:
    layout: Layout | None
    reason: str


class ScalingPolicy:
    """Chooses the layout for the workers available, within [min_workers, max_workers].

    `choose(world, cfg, previous) -> (Layout, reason)` defaults to the planner's
    `choose_layout`: keep tp and pp, change the data-parallel degrees, keep
    the global batch divisible."""

    def __init__(self, cfg: JobConfig, choose=None):
        self.cfg = cfg
        if choose is None:
            from elastic.planning import choose_layout as choose
        self.choose = choose

    def decide(self, available: int, previous: Layout | None) -> ScalingDecision:
        s = self.cfg.scaling
        world = min(available, s.upper)
        if world < s.min_workers:
            return ScalingDecision(None, f"{available} workers available, below scaling.min_workers={s.min_workers}")
        try:
            layout, why = self.choose(world, self.cfg, previous)
        except LayoutError as exc:
            return ScalingDecision(None, str(exc))
        if layout.world_size < s.min_workers:
            return ScalingDecision(None, f"best layout {layout} has {layout.world_size} ranks, below scaling.min_workers={s.min_workers}")
        return ScalingDecision(layout, why)

    def should_grow(self, available: int, current: Layout) -> bool:
        decision = self.decide(available, current)
        return decision.layout is not None and decision.layout.world_size > current.world_size
