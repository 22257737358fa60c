"""Text timelines of pipeline schedules: which stage runs which forward or backward when.

Each stage (pipeline rank) gets the op order its schedule prescribes; a small
simulation then places every op in the first time slot where its inputs exist:
the forward of a micro-batch needs the previous (virtual) stage's forward, and
its backward needs the next stage's backward. Every op takes one slot. A real
backward costs about twice a forward, so the drawing shows the order and the
dependency structure, not exact durations; with equal slots the idle share of
a 1F1B or GPipe drawing is exactly the bubble formula `(p-1)/(m+p-1)`.

Pure Python: used by `elastic plan --timeline` and by the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
IDLE = "."


@dataclass(frozen=True)
class Op:
    """One forward ("F") or backward ("B") of one micro-batch on one model chunk of a stage."""

    kind: str
    microbatch: int
    chunk: int = 0

    def label(self, chunks: int) -> str:
        """`F3`, or `F3.1` (micro-batch 3 on chunk 1) when each stage holds several chunks."""
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if chunks > 1 else "")


def _gpipe_order(microbatches: int) -> list[Op]:
    """All forwards, then all backwards: simple, but every micro-batch's activations are alive at once."""
    return [Op("F", i) for i in range(microbatches)] + [Op("B", i) for i in range(microbatches)]


def _one_f_one_b_order(stage: int, stages: int, microbatches: int) -> list[Op]:
    """Warm up with `p-s-1` forwards, then alternate one forward and one backward, then drain.

    The warm-up is just deep enough that the stage never waits for a forward in
    the steady state, and it bounds the micro-batches in flight on stage s to
    `p-s` instead of GPipe's m.
    """
    warmup = min(stages - stage - 1, microbatches)
    order = [Op("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [Op("F", warmup + i), Op("B", i)]
    return order + [Op("B", i) for i in range(microbatches - warmup, microbatches)]


def _interleaved_op(kind: str, k: int, stages: int, chunks: int) -> Op:
    """The k-th forward (or backward) of a stage in Megatron's interleaved order.

    Micro-batches advance in groups of `p`: a group runs through chunk 0, then
    chunk 1, ...; backwards visit the chunks in reverse. Groups of `p` keep
    every stage busy while the group travels around the ring of stages.
    """
    group, within = divmod(k, stages * chunks)
    chunk = within // stages
    return Op(kind, group * stages + within % stages, chunk if kind == "F" else chunks - 1 - chunk)


def _interleaved_order(stage: int, stages: int, microbatches: int, chunks: int) -> list[Op]:
    """Interleaved 1F1B: a longer warm-up (`2(p-s-1) + (v-1)p` chunk forwards), then 1F1B over chunks."""
    total = microbatches * chunks
    warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    order = [_interleaved_op("F", k, stages, chunks) for k in range(warmup)]
    for k in range(total - warmup):
        order += [_interleaved_op("F", warmup + k, stages, chunks), _interleaved_op("B", k, stages, chunks)]
    return order + [_interleaved_op("B", k, stages, chunks) for k in range(total - warmup, total)]


def stage_orders(schedule: str, stages: int, microbatches: int, virtual: int = 2) -> list[list[Op]]:
    """The op sequence each stage executes under `schedule`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages ({stages}) and micro-batches ({microbatches}) must be >= 1")
    if schedule == "gpipe":
        return [_gpipe_order(microbatches) for _ in range(stages)]
    if schedule == "1f1b":
        return [_one_f_one_b_order(s, stages, microbatches) for s in range(stages)]
    if virtual < 1:
        raise ValueError(f"virtual stages per rank ({virtual}) must be >= 1")
    if microbatches % stages:
        raise ValueError(f"interleaved 1F1B groups micro-batches by stage: {microbatches} micro-batches is not a multiple of {stages} stages")
    return [_interleaved_order(s, stages, microbatches, virtual) for s in range(stages)]


def _ready(op: Op, stage: int, stages: int, chunks: int, done: dict, slot: int) -> bool:
    """Whether the op's input was produced in an earlier slot (virtual stage = chunk * p + stage)."""
    vstage = op.chunk * stages + stage
    if op.kind == "F":
        dep = ("F", vstage - 1, op.microbatch) if vstage > 0 else None
    else:
        dep = ("B", vstage + 1, op.microbatch) if vstage < stages * chunks - 1 else ("F", vstage, op.microbatch)
    return dep is None or done.get(dep, slot) < slot


def simulate(orders: list[list[Op]], chunks: int = 1) -> list[list[Op | None]]:
    """Place each stage's ops in time slots as soon as their inputs exist; None marks an idle slot."""
    stages = len(orders)
    grid: list[list[Op | None]] = [[] for _ in orders]
    nxt = [0] * stages
    done: dict[tuple[str, int, int], int] = {}
    slot = 0
    while any(n < len(order) for n, order in zip(nxt, orders)):
        ran = [order[nxt[s]] if nxt[s] < len(order) and _ready(order[nxt[s]], s, stages, chunks, done, slot) else None for s, order in enumerate(orders)]
        if not any(ran):
            raise ValueError(f"the schedule's op orders deadlock: no stage can run in slot {slot}")
        for s, op in enumerate(ran):
            grid[s].append(op)
            if op is not None:
                done[(op.kind, op.chunk * stages + s, op.microbatch)] = slot
                nxt[s] += 1
        slot += 1
    return grid


def timeline(schedule: str, stages: int, microbatches: int, virtual: int = 2) -> list[list[Op | None]]:
    """Slot grid of a schedule: `grid[stage][slot]` is the op run there, or None when idle."""
    chunks = virtual if schedule == "interleaved_1f1b" else 1
    return simulate(stage_orders(schedule, stages, microbatches, virtual), chunks)


def idle_fraction(grid: list[list[Op | None]]) -> float:
    """Share of stage-slots spent idle: the drawing's own bubble."""
    cells = [cell for row in grid for cell in row]
    return sum(cell is None for cell in cells) / len(cells)


def render(grid: list[list[Op | None]], chunks: int = 1) -> str:
    """One row per stage, `stage 0: F0 F1 .  B0 ...`, with columns aligned across stages."""
    labels = [[IDLE if op is None else op.label(chunks) for op in row] for row in grid]
    width = max(len(label) for row in labels for label in row)
    head = len(f"stage {len(grid) - 1}")
    return "\n".join(f"{f'stage {s}':<{head}}: " + " ".join(f"{x:<{width}}" for x in row).rstrip() for s, row in enumerate(labels))


def render_timeline(schedule: str, stages: int, microbatches: int, virtual: int = 2) -> str:
    """The schedule drawn as text, with a one-line legend and the drawing's idle share."""
    grid = timeline(schedule, stages, microbatches, virtual)
    chunks = virtual if schedule == "interleaved_1f1b" else 1
    legend = f"{schedule}: {stages} stages x {microbatches} micro-batches" + (f" x {chunks} chunks per stage" if chunks > 1 else "")
    notes = "F/B = forward/backward of micro-batch N" + (" on chunk C (N.C)" if chunks > 1 else "") + f", {IDLE} = idle"
    return f"{legend}; {notes}; idle {idle_fraction(grid):.1%}\n{render(grid, chunks)}"
