"""Fault injection specs: `KIND:key=value,...`, from `--inject` or `fault.inject` in the YAML.

Kinds:
- `kill:rank=R,step=S`     the worker SIGKILLs its own process at the start of step S
- `node:rank=R,step=S[,back=T]`  the controller removes the Ray node that hosts rank R when it reaches
                           step S; with back=T a fresh node joins T seconds later (a spot node returning)
- `hang:rank=R,step=S[,where=data|collective]`  the rank blocks in its data loader or in a collective the others never join
- `kill_during_save:rank=R,step=S`  the rank SIGKILLs itself while writing the checkpoint of step S
- `corrupt:step=S`         after step S, the newest committed checkpoint gets flipped bytes before the next restore
`random:count=N,seed=K,steps=A-B,ranks=R[,kinds=kill+node+...][,back=T]` expands into N seeded faults
at random ranks and steps, cycling through the kinds; its node faults come back after T (3) seconds.

A fault fires once: it belongs to the first generation that reaches its step.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

KINDS = ("kill", "node", "hang", "kill_during_save", "corrupt")


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    id: int
    kind: str
    step: int
    rank: int = 0
    where: str = "data"
    back_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _parse_one(spec: str, next_id: int) -> list[Fault]:
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    params: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise FaultSpecError(f"--inject {spec!r}: expected key=value, got {item!r}")
        params[key.strip()] = value.strip()
    if kind == "random":
        return _random_faults(params, spec, next_id)
    if kind not in KINDS:
        raise FaultSpecError(f"--inject {spec!r}: unknown kind {kind!r} (one of {', '.join(KINDS)}, random)")
    allowed = {"rank", "step", "where", "back"}
    unknown = set(params) - allowed
    if unknown:
        raise FaultSpecError(f"--inject {spec!r}: unknown key(s) {', '.join(sorted(unknown))}")
    try:
        step = int(params["step"])
        rank = int(params.get("rank", 0))
        back_s = float(params.get("back", 0))
    except KeyError:
        raise FaultSpecError(f"--inject {spec!r}: step= is required") from None
    except ValueError:
        raise FaultSpecError(f"--inject {spec!r}: rank and step must be integers, back a number of seconds") from None
    where = params.get("where", "data")
    if where not in ("data", "collective"):
        raise FaultSpecError(f"--inject {spec!r}: where must be data or collective")
    if step < 0 or rank < 0:
        raise FaultSpecError(f"--inject {spec!r}: rank and step must be >= 0")
    if back_s and kind != "node":
        raise FaultSpecError(f"--inject {spec!r}: back= applies to node faults only")
    return [Fault(id=next_id, kind=kind, step=step, rank=rank, where=where, back_s=back_s)]


def _random_faults(params: dict[str, str], spec: str, next_id: int) -> list[Fault]:
    try:
        count = int(params.get("count", 10))
        seed = int(params.get("seed", 0))
        lo, hi = (int(v) for v in params.get("steps", "5-100").split("-"))
        ranks = int(params.get("ranks", 4))
        back_s = float(params.get("back", 3.0))  # random node faults come back, so the job can grow again
    except ValueError:
        raise FaultSpecError(f"--inject {spec!r}: count, seed, ranks must be integers, steps A-B, back seconds") from None
    kinds = params.get("kinds", "+".join(KINDS)).split("+")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise FaultSpecError(f"--inject {spec!r}: unknown kind(s) {', '.join(bad)}")
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(lo, hi), count)) if hi - lo >= count else sorted(rng.randrange(lo, hi) for _ in range(count))
    # Cycle the kinds so every kind appears; shuffle their order with the seed.
    order = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(order)
    return [
        Fault(
            id=next_id + i, kind=kind, step=step, rank=rng.randrange(ranks), where=rng.choice(("data", "collective")),
            back_s=back_s if kind == "node" else 0.0,
        )
        for i, (kind, step) in enumerate(zip(order, steps))
    ]


def parse_faults(specs: list[str]) -> list[Fault]:
    out: list[Fault] = []
    for spec in specs:
        out.extend(_parse_one(spec, len(out)))
    return out
