"""Fault injection specs: `KIND:key=value,...`, from `--inject` or `fault.inject` in the YAML.

Kinds and the keys each takes (rank defaults to 0; step is required):
- `kill:rank=R,step=S`     the worker SIGKILLs its own process once S steps are done, before step S+1
- `node:rank=R,step=S[,back=T][,peer=1]`  the controller removes the Ray node that hosts rank R when it reaches
                           step S; with back=T a fresh node joins T seconds later (a spot node returning); with
                           peer=1 the node that holds its memory-tier replicas goes at the same moment
- `hang:rank=R,step=S[,where=data|collective]`  the rank blocks in its data loader or in a collective the others never join
- `kill_during_save:rank=R,step=S`  the rank SIGKILLs itself while writing the first checkpoint at or after step S
- `corrupt:step=S[,where=durable|memory]`  after step S, the newest committed durable checkpoint (or, with
                           where=memory, every memory-tier snapshot on every node) gets flipped bytes before the next restore
`random:count=N,seed=K,steps=A-B,ranks=R[,kinds=kill+node+...][,back=T]` expands into N seeded faults
(1 <= N <= MAX_RANDOM_FAULTS; defaults count=10, seed=0, steps=5-100, ranks=4) at random ranks in
[0, R) and steps in [A, B), cycling through the kinds; its node faults come back after T (3) seconds.

A spec is refused (FaultSpecError, the message starting with the spec) for an unknown kind or key, a
key given twice or one its kind does not use, a character that belongs in no key or value (such as
`;`), a negative rank or step, or a `back` that is negative or not finite. Given the job,
`unreachable` refuses a fault that can never fire: a rank that no layout of the job has, or a step
the job never reaches.

A fault fires once: it belongs to the first generation that reaches its step. Step numbers count
completed optimizer steps, as everywhere (README, "Step numbers"): a fault at step S fires when S steps
are done (step=0: before the first step), and the report shows it at step S.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import asdict, dataclass

KINDS = ("kill", "node", "hang", "kill_during_save", "corrupt")
KEYS = {
    "kill": ("rank", "step"),
    "node": ("rank", "step", "back", "peer"),
    "hang": ("rank", "step", "where"),
    "kill_during_save": ("rank", "step"),
    "corrupt": ("step", "where"),
    "random": ("count", "seed", "steps", "ranks", "kinds", "back"),
}
"""The keys each kind takes; any other key is refused rather than ignored."""
WHERE = {"hang": ("data", "collective"), "corrupt": ("durable", "memory")}
"""The values `where=` takes, by kind; the first is the default."""
MAX_RANDOM_FAULTS = 1000
"""The most faults one `random:` spec may expand into (more could never fire in a run that ends)."""

MAX_VALUE_CHARS = 32
"""The longest value a key takes (a 64-bit integer has 20 digits)."""

_KEY_CHARS = re.compile(r"[a-z_]+")
_VALUE_CHARS = re.compile(r"[A-Za-z0-9_.+-]+")


class FaultSpecError(ValueError):
    """A fault spec that cannot be used; the message starts with the spec and says why."""


@dataclass(frozen=True)
class Fault:
    id: int
    kind: str
    step: int
    rank: int = 0
    where: str = "data"
    back_s: float = 0.0
    peer: bool = False  # a node fault that also removes the node holding its memory replicas

    def as_dict(self) -> dict:
        return asdict(self)


def _params(spec: str, kind: str, rest: str) -> dict[str, str]:
    """`key=value,...` as a dict; a stray character, a missing `=`, an unknown or repeated key is named."""
    params: dict[str, str] = {}
    for item in (p.strip() for p in rest.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise FaultSpecError(f"{spec!r}: expected key=value, got {item!r}")
        if not value:
            raise FaultSpecError(f"{spec!r}: {key}= has no value")
        if len(value) > MAX_VALUE_CHARS:
            raise FaultSpecError(f"{spec!r}: the value of {key}= is longer than {MAX_VALUE_CHARS} characters")
        for text, allowed in ((key, _KEY_CHARS), (value, _VALUE_CHARS)):
            stray = next((c for c in text if not allowed.fullmatch(c)), None)
            if stray is not None:
                raise FaultSpecError(f"{spec!r}: unexpected {stray!r} in {item!r} (write key=value pairs separated by ',')")
        if key not in KEYS[kind]:
            raise FaultSpecError(f"{spec!r}: unknown key {key!r} for {kind} (takes {', '.join(KEYS[kind])})")
        if key in params:
            raise FaultSpecError(f"{spec!r}: {key}= is given twice")
        params[key] = value
    return params


def _int(spec: str, params: dict[str, str], key: str, default: int | None, low: int) -> int:
    """An integer key >= `low`; `default` None means the key is required."""
    if key not in params:
        if default is None:
            raise FaultSpecError(f"{spec!r}: {key}= is required")
        return default
    try:
        value = int(params[key])
    except ValueError:
        raise FaultSpecError(f"{spec!r}: {key} must be an integer, got {params[key]!r}") from None
    if value < low:
        raise FaultSpecError(f"{spec!r}: {key} must be >= {low}, got {value}")
    return value


def _seconds(spec: str, params: dict[str, str], default: float) -> float:
    """`back=T`: a finite number of seconds >= 0."""
    text = params.get("back")
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise FaultSpecError(f"{spec!r}: back must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise FaultSpecError(f"{spec!r}: back must be a finite number of seconds >= 0, got {text!r}")
    return value


def _parse_one(spec: str, next_id: int) -> list[Fault]:
    kind, sep, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in KEYS:
        raise FaultSpecError(f"{spec!r}: unknown kind {kind!r} (one of {', '.join(KINDS)}, random)")
    if not sep:
        raise FaultSpecError(f"{spec!r}: expected {kind}:key=value,... (takes {', '.join(KEYS[kind])})")
    params = _params(spec, kind, rest)
    if kind == "random":
        return _random_faults(params, spec, next_id)
    choices = WHERE.get(kind, ("data",))
    where = params.get("where", choices[0])
    if where not in choices:
        raise FaultSpecError(f"{spec!r}: where must be {' or '.join(choices)}, got {where!r}")
    peer = _int(spec, params, "peer", 0, 0)
    if peer > 1:
        raise FaultSpecError(f"{spec!r}: peer must be 0 or 1, got {peer}")
    return [Fault(id=next_id, kind=kind, step=_int(spec, params, "step", None, 0), rank=_int(spec, params, "rank", 0, 0),
                  where=where, back_s=_seconds(spec, params, 0.0), peer=bool(peer))]


def _random_faults(params: dict[str, str], spec: str, next_id: int) -> list[Fault]:
    count = _int(spec, params, "count", 10, 1)
    if count > MAX_RANDOM_FAULTS:
        raise FaultSpecError(f"{spec!r}: count must be <= {MAX_RANDOM_FAULTS}, got {count}")
    seed = _int(spec, params, "seed", 0, 0)
    ranks = _int(spec, params, "ranks", 4, 1)
    back_s = _seconds(spec, params, 3.0)  # random node faults come back, so the job can grow again
    match = re.fullmatch(r"(\d+)-(\d+)", params.get("steps", "5-100"))
    if not match or int(match[1]) >= int(match[2]):
        raise FaultSpecError(f"{spec!r}: steps must be A-B with 0 <= A < B (faults at steps A..B-1), got {params['steps']!r}")
    lo, hi = int(match[1]), int(match[2])
    kinds = params.get("kinds", "+".join(KINDS)).split("+")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise FaultSpecError(f"{spec!r}: unknown kind(s) {', '.join(map(repr, bad))} in kinds= (one of {', '.join(KINDS)})")
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(lo, hi), count)) if hi - lo >= count else sorted(rng.randrange(lo, hi) for _ in range(count))
    # Cycle the kinds so every kind appears; shuffle their order with the seed.
    order = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(order)
    return [
        Fault(
            id=next_id + i, kind=kind, step=step, rank=rng.randrange(ranks), where=_random_where(kind, rng.choice(("data", "collective"))),
            back_s=back_s if kind == "node" else 0.0,
        )
        for i, (kind, step) in enumerate(zip(order, steps))
    ]


def _random_where(kind: str, drawn: str) -> str:
    """A random fault's `where`: the hang's draw; a corrupt fault's is the durable tier (the one every job has)."""
    return "durable" if kind == "corrupt" else drawn


def parse_faults(specs: list[str], *, first_id: int = 0, steps: int | None = None, max_world: int | None = None) -> list[Fault]:
    """Every spec's faults, numbered in order from `first_id`; FaultSpecError names the first spec that cannot be used.

    Given the job's `steps` and `max_world` (the most ranks any of its layouts
    has), a fault that can never fire is refused too (see `unreachable`).
    """
    out: list[Fault] = []
    for spec in specs:
        faults = _parse_one(spec, first_id + len(out))
        for n, fault in enumerate(faults, 1):
            why = None if steps is None or max_world is None else unreachable(fault, steps, max_world)
            if why and len(faults) > 1:
                raise FaultSpecError(f"{spec!r}: its fault #{n} ({fault.kind} at rank {fault.rank}, step {fault.step}) can never fire: {why}")
            if why:
                raise FaultSpecError(f"{spec!r} can never fire: {why}")
        out.extend(faults)
    return out


def unreachable(fault: Fault, steps: int, max_world: int) -> str | None:
    """Why `fault` can never fire in a job of `steps` steps whose layouts never exceed `max_world` ranks, or None.

    A fault at step S fires once S steps are done. A kill, node or hang fault
    fires before the next step, so the last one that fires is at steps-1
    (before the last step); a corrupt fault arms for the next restore, which
    only a failure in a later step brings, so its last step is steps-1 too;
    a kill during save fires at the first save at or after its step, and the
    last save is at `steps`.
    """
    last = steps if fault.kind == "kill_during_save" else steps - 1
    if fault.step > last:
        return f"step {fault.step} is never reached: training.steps is {steps}, and {_last_step(fault.kind, steps)}"
    if fault.kind != "corrupt" and fault.rank >= max_world:
        return f"rank {fault.rank} never exists: the job's largest layout has {max_world} ranks (0..{max_world - 1})"
    return None


def _last_step(kind: str, steps: int) -> str:
    """The last step a fault of `kind` can fire at, and why, in a job of `steps` steps."""
    if kind == "kill_during_save":
        return f"the last save is at step {steps}"
    if kind == "corrupt":
        return f"only a failure in a later step restores a checkpoint, so the last is step {steps - 1}"
    return f"a fault at step S fires before step S+1 runs, so the last is step {steps - 1}"
