"""The messages between a rank process, its node's agent and the controller.

Agent → rank, over the pipe between them: a `Request` carries one command
(`Start`, `StopAfter`, `DumpStacks`, `Reset`) and an id; the rank answers
each with a `Reply` of the same id. The agent has at most one command out per
rank and drops a reply whose id is not the one it waits for, so an answer
that comes after its deadline is never taken for the next command's. Unasked,
`Replicated` acknowledges a memory snapshot in place on another node.

Rank → agent, unasked: `Ready` once it has imported what a generation needs
(or `StartFailed`), and its `RankState` whenever it has news. A rank that
restores from the memory tier asks, with `Pull`, for the bytes it reads;
the agent answers `Pulled` once they are on the node. A CPU rank has its
memory snapshots copied out of its memory by the agent (`CopyOut`), which
answers `Copied` once the file is complete.

Agent → controller: a `RankStatus` per rank from each poll.

The records inside a `RankState` stay the dicts that `elastic.train.Progress`
records ("step", "saved", "ready", "paused"): the controller and the
checkpoint commit read them by kind, and typing each kind would reach far
into the training loop for no gain at the boundary.

Nothing here imports torch or Ray: a rank process reads this module before it
imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# -- agent -> rank -------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """Join the generation's process group and train; `spec` holds `elastic.train.RankSpec`'s fields."""

    spec: dict
    store_host: str
    store_port: int
    timeout_s: float


@dataclass(frozen=True)
class StopAfter:
    """Finish `step` (counting completed steps), save, and end the loop: a planned resize loses nothing."""

    step: int


@dataclass(frozen=True)
class DumpStacks:
    """Answer with a `StackDump` of every thread."""


@dataclass(frozen=True)
class Reset:
    """End the generation: stop the loop and drop the process group. A loop still running after `grace_s` has its
    collectives aborted; answer False if it is still stuck `ABORT_JOIN_S` after that."""

    grace_s: float

    @property
    def longest_s(self) -> float:
        """The longest a reset takes before it answers."""
        return self.grace_s + ABORT_JOIN_S


ABORT_JOIN_S = 1.0
"""How long a reset waits for a loop whose collectives it aborted to return."""


Command = Start | StopAfter | DumpStacks | Reset


@dataclass(frozen=True)
class Request:
    id: int
    command: Command


@dataclass(frozen=True)
class Replicated:
    """The agent is done with the rank's memory snapshot of `step` (of `generation`): it may train on.

    `ok`: the replica is in place on another node (False: the copy failed, and the step has none).
    """

    generation: int
    step: int
    ok: bool = True


@dataclass(frozen=True)
class Hurry:
    """The rank must wait for its memory snapshot of `step` (its copy, or its replica): the agent lifts the idle work
    it waits on (`elastic.sched.Background.hurry`), and has its peer lift the replica's receiving end."""

    generation: int
    step: int


@dataclass(frozen=True)
class Copied:
    """The answer to the rank's `CopyOut` of `step` (of `generation`): the file is complete on this node, or `error`
    says why not; `refused`: the kernel does not let the agent read the rank's memory (the rank writes its own)."""

    generation: int
    step: int
    error: str | None = None
    refused: bool = False


@dataclass(frozen=True)
class Pulled:
    """The answer to the rank's `Pull` `id`: the ranges are in this node's memory (those of the files `fetched`,
    `nbytes` in all, came from other nodes now), or `error` says why not."""

    id: int
    fetched: tuple[str, ...] = ()
    nbytes: int = 0
    error: str | None = None


# -- rank -> agent ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Pull:
    """A rank restoring from the memory tier reads these byte ranges of the staged step's data files ({name in the
    step's directory: [(start, end)]}): the agent fetches those its node lacks from the nodes that hold them, then
    answers `Pulled`."""

    id: int
    ranges: dict[str, list[tuple[int, int]]]


@dataclass(frozen=True)
class CopyOut:
    """Copy the rank's memory snapshot of `step` out of its memory into this node's memory directory
    (`storage.copy_out`): `size` bytes (0: the rank has nothing to store) from `regions` ((address, nbytes, offset in
    the file)), with the rows `heads` (None: those of the rank's previous CopyOut) and the rank's newest step
    `records`. `reuse`: as `elastic.memory.NodeMemory.keep_two`'s; `t0`: when the rank asked (the snapshot's time).
    The rank changes none of those bytes until `Copied` comes."""

    generation: int
    step: int
    rank: int
    size: int
    regions: list[tuple[int, int, int]]
    heads: list[str] | None
    records: list[dict]
    reuse: bool
    t0: float


@dataclass(frozen=True)
class Reply:
    """The answer to the request `id`: `value` (None for Start and StopAfter, a StackDump, a bool for Reset) or the error it raised."""

    id: int
    value: object = None
    error: str | None = None  # the command raised: its traceback


@dataclass(frozen=True)
class Ready:
    """The process has imported torch and the training code: it can take a generation."""

    pid: int


@dataclass(frozen=True)
class StartFailed:
    """The process could not import what a generation needs; it exits after this."""

    error: str  # the traceback


@dataclass(frozen=True)
class StackDump:
    """Where a rank's threads are: its training thread apart from the others, for naming the culprit of a hang."""

    training: str | None  # the training thread's stack; None when no generation is running, or no answer came
    others: str = ""  # every other thread's stack, each under a '--- thread NAME' line

    @classmethod
    def missing(cls, why: str) -> StackDump:
        return cls(None, f"<no stack: {why}>")

    def text(self) -> str:
        """For a human: the training thread first."""
        training = f"--- training thread\n{self.training}" if self.training is not None else "--- no training thread"
        return f"{training}\n{self.others}" if self.others else training


@dataclass
class RankState:
    """What a rank pushes about its current generation; a poll hands it on with the records since the last poll."""

    generation: int  # -1: idle, between generations
    step: int  # the step it is in (-1 before the first)
    phase: str  # one of elastic.train.PHASES, or "idle"
    phase_since: float  # wall-clock time it entered `phase`
    records: list[dict] = field(default_factory=list)  # Progress records, oldest first
    finished: bool = False  # the loop trained to the last step
    error: str | None = None  # the loop ended with this traceback


# -- agent -> controller -----------------------------------------------------------------------


@dataclass(frozen=True)
class RankStatus:
    """One rank, as a poll found it: alive with its state, or dead and why."""

    rank: int
    alive: bool
    state: RankState | None = None  # alive: its latest state, records since the last poll
    error: str | None = None  # dead: how its process (or its node's agent) ended
