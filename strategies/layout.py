"""The parallel layout: one validated object that owns all rank arithmetic.

A layout is the four degrees `(pp, dp_replicate, dp_shard, tp)` whose product
is the world size. The mesh axes are named and ordered outermost to innermost,
so `tp` groups are consecutive ranks (kept on one node by placement) and the
pipeline axis is outermost (its point-to-point traffic crosses nodes best).
Nothing else in the project computes coordinates from a rank.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterator

AXES = ("pp", "dp_replicate", "dp_shard", "tp")


class LayoutError(ValueError):
    """A layout that does not fit the world size, the batch or the model."""


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise LayoutError(f"layout.{axis} must be >= 1, got {getattr(self, axis)}")

    # -- sizes ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of a global batch run at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:
        return "x".join(f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a) > 1) or "single"

    # -- coordinates -----------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a rank (row-major over AXES, tp fastest)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world size {self.world_size}")
        out: dict[str, int] = {}
        for axis in reversed(AXES):
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return {axis: out[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for axis in AXES:
            rank = rank * getattr(self, axis) + coords.get(axis, 0)
        return rank

    def dp_rank(self, rank: int) -> int:
        """Index of the rank's data slice: replicate-major, then shard."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def is_data_reporter(self, rank: int) -> bool:
        """One rank per data slice reports which samples it consumed (and the loss): tp 0 of the last stage."""
        c = self.coords(rank)
        return c["tp"] == 0 and c["pp"] == self.pp - 1

    def ranks(self) -> Iterator[int]:
        return iter(range(self.world_size))

    # -- batch bookkeeping -------------------------------------------------------
    def local_batch(self, global_batch: int) -> int:
        """Samples each data-parallel rank takes per step; the global batch never changes."""
        if global_batch % self.dp:
            raise LayoutError(f"global batch {global_batch} is not divisible by the data-parallel degree {self.dp}")
        return global_batch // self.dp

    def grad_accum_steps(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches per step on each rank (the last one may be smaller)."""
        return math.ceil(self.local_batch(global_batch) / micro_batch)

    # -- building ----------------------------------------------------------------
    def build_mesh(self, device_type: str):
        """The named 4-D DeviceMesh for the current process group."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=AXES)

    @classmethod
    def for_world(cls, world: int, *, pp: int = 1, tp: int = 1, dp_replicate: int = 1, dp_shard: int = -1) -> "Layout":
        """Fill a layout to `world` ranks: `dp_shard=-1` takes what pp, tp and dp_replicate leave."""
        fixed = pp * tp * dp_replicate
        if dp_shard == -1:
            if world % fixed:
                raise LayoutError(f"world size {world} is not divisible by pp*dp_replicate*tp = {fixed}")
            dp_shard = world // fixed
        layout = cls(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
        if layout.world_size != world:
            raise LayoutError(f"layout {layout} has {layout.world_size} ranks, not the world size {world}")
        return layout
