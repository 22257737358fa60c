"""Training state as flat, layout-independent named tensors, and what of it each rank writes.

Names are the model's full parameter names (FSDP2, tensor parallel and
pipeline stages all keep them), so the same key means the same global tensor
at every layout: `model.<fqn>` for parameters, `optim.<fqn>.<state>` for the
optimizer's per-parameter state (AdamW: `exp_avg`, `exp_avg_sq`, `step`).
The dict holds the live tensors: saving reads them, loading fills them in
place, so after a load the optimizer continues exactly where the saved one was.

A rank writes only the pieces it is the chosen writer of. A piece held by
several ranks (a `Replicate` mesh dimension, a root-mesh dimension the tensor's
mesh does not span such as `tp` for an FSDP-only norm weight, or a plain tensor
such as AdamW's `step`, which lives on every rank of its parameter's mesh) is
written by one of its holders, picked by a hash of the key and the piece's
shard coordinates, so different pieces land on different replicas. Every rank
computes the choice from its own coordinates: no communication. Only the
mesh dimension named `pp` is taken to split parameters rather than copy them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from storage.boxes import Box, local_boxes, split_rows
from storage.format import DTYPE_SIZES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
"""The stored dtypes' torch dtypes, by the names a checkpoint's index gives them."""

PIECE_BYTES = 16 << 20
"""Stored pieces are cut along their first dimension to at most this size: a reshard reads at most this much extra per box edge."""


def state_tensors(model_parts: list[nn.Module], optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """The live training state under layout-independent names.

    Creates the optimizer's state where it has none yet (a step with zero
    gradients at learning rate 0, which leaves the parameters as they are), so
    the result also serves as the template that a load fills.
    """
    out: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    for part in model_parts:
        for fqn, param in part.named_parameters():
            out[f"model.{fqn}"] = param
            names[id(param)] = fqn
    if optimizer is None:
        return out
    missing = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad and not optimizer.state.get(p)]
    if missing:
        _init_optimizer_state(optimizer, missing)
    for group in optimizer.param_groups:
        for param in group["params"]:
            fqn = names.get(id(param))
            if fqn is None:
                raise ValueError("the optimizer holds a parameter that is not in model_parts")
            for name, value in optimizer.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state {fqn}.{name} is a {type(value).__name__}, not a tensor")
                out[f"optim.{fqn}.{name}"] = value
    return out


def _init_optimizer_state(optimizer: torch.optim.Optimizer, missing: list[torch.Tensor]) -> None:
    """Make the optimizer create the state of `missing`: one step at learning rate 0 where only they have (zero) gradients.

    Parameters and the state of every other parameter stay untouched, and so
    do the gradients accumulated so far. The new step counts go back to 0:
    for Adam(W) the state is then exactly what a first real step would start from.

    The step runs on the DTensor parameters' local tensors, and the state is
    then placed like its parameter (what the step on the DTensor gives, as
    `zeros_like` of a DTensor does): on DTensors each op of the step pays a
    sharding propagation for the new mesh, 0.5 s of CPU per rank for the
    demo's 2-layer model at every load of a new generation. An optimizer with
    state of another shape than its parameter's takes the step on the DTensors.
    """
    local = {id(p): p.to_local().detach() for p in missing if isinstance(p, DTensor)}
    if local:
        _zero_lr_step(optimizer, missing, local)
        placed = {id(p): {k: _placed_like(p, v) for k, v in optimizer.state.pop(local[id(p)]).items()}
                  for p in missing if id(p) in local}
        if all(v is not None for state in placed.values() for v in state.values()):
            for p in missing:
                optimizer.state[p] = placed.get(id(p)) or optimizer.state[p]
            return
        for p in missing:
            optimizer.state.pop(p, None)
    _zero_lr_step(optimizer, missing, {})


def _zero_lr_step(optimizer: torch.optim.Optimizer, missing: list[torch.Tensor], stand_ins: dict[int, torch.Tensor]) -> None:
    """One step at learning rate 0 in which only `missing` (or their stand-ins, by id, in their places in the param
    groups) have gradients, zeros; everything else is put back as it was, and the new step counts go back to 0."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    groups = [(g["params"], g["lr"]) for g in optimizer.param_groups]
    stepped = [stand_ins.get(id(p), p) for p in missing]
    for p in params:
        p.grad = None
    for t in stepped:
        t.grad = torch.zeros_like(t)
    for group in optimizer.param_groups:
        group["params"] = [stand_ins.get(id(p), p) for p in group["params"]]
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
        for t in stepped:
            if isinstance(optimizer.state[t].get("step"), torch.Tensor):
                optimizer.state[t]["step"].zero_()
    finally:
        for group, (params_of, lr) in zip(optimizer.param_groups, groups):
            group["params"], group["lr"] = params_of, lr
        for t in stepped:
            t.grad = None
        for p, g in zip(params, grads):
            p.grad = g


def _placed_like(param: DTensor, value):
    """State made on `param`'s local tensor, as the state of `param`: a tensor of the local shape becomes a DTensor
    placed like `param`; a scalar (AdamW's `step`) or a non-tensor stays as it is; None for any other shape."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.shape != param.to_local().shape:
        return None
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())


@dataclass
class LocalPart:
    """What one rank stores of one global tensor: its pieces, each a box with its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[tuple[Box, torch.Tensor]]
    raws: list[memoryview | None] | None = None
    """The pieces' bytes where they are in CPU memory as they are (`piece_bytes`), one per piece; None: not known."""


def piece_bytes(data: torch.Tensor) -> memoryview | None:
    """A piece's bytes in place, without a copy; None where it has to be copied first (not in CPU memory, or not
    contiguous)."""
    if data.device.type != "cpu" or not data.is_contiguous():
        return None
    return memoryview(data.detach().reshape(-1).view(torch.uint8).numpy())


def local_view(local: torch.Tensor, box: Box) -> torch.Tensor:
    """The part of a local tensor that a box (with its `local` offsets) covers."""
    view = local
    for dim, (start, length) in enumerate(zip(box.local, box.lengths)):
        view = view.narrow(dim, start, length)
    return view


def tensor_boxes(t: torch.Tensor) -> tuple[torch.Tensor, list[Box]]:
    """The local data of a tensor and the boxes of the global tensor it holds."""
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        coords = mesh.get_coordinate()
        if coords is None:
            return t.to_local(), []
        return t.to_local(), local_boxes(tuple(t.shape), tuple(mesh.shape), coords, t.placements)
    shape = tuple(t.shape)
    return t, [Box((0,) * len(shape), shape, (0,) * len(shape))]


def _copies_outside(mesh) -> tuple[int, int]:
    """How many copies of `mesh` the root mesh holds along the dims `mesh` does not span, and which one this rank is in.

    A tensor on a sub-mesh is the same on every rank that differs from this one
    only along such a dim (a norm weight FSDP shards over `dp_shard` is held
    alike by every `tp` rank) -- except along `pp`, whose ranks hold other
    parameters altogether.
    """
    root = mesh._get_root_mesh()
    if root is mesh:
        return 1, 0
    where = {int(r): c for c, r in numpy.ndenumerate(root.mesh.numpy())}
    mine = [where[int(r)] for r in mesh.mesh.flatten().tolist()]
    spanned = {d for d in range(root.ndim) if len({c[d] for c in mine}) > 1}
    names = root.mesh_dim_names or ()
    me = root.get_coordinate()
    count, index = 1, 0
    for d in range(root.ndim):
        if d not in spanned and not (names and names[d] == "pp"):
            count, index = count * root.shape[d], index * root.shape[d] + me[d]
    return count, index


def is_writer(key: str, shard_coords, replica_axes) -> bool:
    """Whether this holder writes the piece of `key` at `shard_coords` (its coordinates along the sharded mesh dims).

    `replica_axes` are (size, this rank's coordinate) along every axis whose
    ranks hold the same piece, in a fixed order; exactly one coordinate along
    them is picked, by a hash of key and shard coordinates, so different pieces
    land on different replicas. Pure arithmetic: a simulation can decide for
    any rank of any layout.
    """
    replicas, index = 1, 0
    for size, coord in replica_axes:
        replicas, index = replicas * size, index * size + coord
    return zlib.crc32(f"{key}@{list(shard_coords)}".encode()) % replicas == index


def _replica_choice(key: str, t: torch.Tensor, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether this rank is the one writer among the ranks that hold the same pieces of `t`.

    The replica axes are the root-mesh dims the tensor's mesh does not span
    (except `pp`), in root order, then the tensor mesh's dims that do not shard it.
    """
    if isinstance(t, DTensor):
        mesh, coords = t.device_mesh, t.device_mesh.get_coordinate()
        sharded = [isinstance(p, (Shard, _StridedShard)) for p in t.placements]
    else:
        anchor = tensors.get("model." + key.split(".", 1)[1].rsplit(".", 1)[0]) if key.startswith("optim.") else None
        if not isinstance(anchor, DTensor):
            world = dist.get_world_size() if dist.is_initialized() else 1
            rank = dist.get_rank() if dist.is_initialized() else 0
            return zlib.crc32(key.encode()) % world == rank
        # Optimizer scalars live wherever their parameter does: on every rank of its mesh.
        mesh, coords = anchor.device_mesh, anchor.device_mesh.get_coordinate()
        sharded = [False] * mesh.ndim
    replicas, index = _copies_outside(mesh)
    axes = [(replicas, index)]
    axes += [(mesh.shape[d], coords[d]) for d, is_shard in enumerate(sharded) if not is_shard]
    return is_writer(key, [c for c, is_shard in zip(coords, sharded) if is_shard], axes)


@dataclass
class _Planned:
    """A tensor's entry in a layout cache: its global shape and the boxes this rank writes, with their views of the
    local tensor they were cut from (cut again when the tensor or its storage changes)."""

    shape: tuple[int, ...]
    boxes: list[Box]
    local: torch.Tensor | None = None
    data_ptr: int = 0
    views: list[tuple[Box, torch.Tensor]] = field(default_factory=list)
    raws: list[memoryview | None] = field(default_factory=list)


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself (`to_local()` makes a new view through autograd at every call); a tensor as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


def plan_writes(tensors: dict[str, torch.Tensor], layout_cache: dict | None = None) -> dict[str, LocalPart]:
    """The pieces this rank writes, as views of the live tensors (no copy).

    Which boxes a tensor holds and whether this rank is their writer is
    device-mesh arithmetic per tensor, which on a small model costs more than
    writing the data; the answer changes only with the layout. A
    `layout_cache` (a dict kept by the caller for saves of one model at one
    layout) keeps it from save to save, and the views too while the tensors
    stay the same (a memory snapshot every step spent a third of its CPU
    cutting them), and the views' bytes (`piece_bytes`): it holds on to the
    tensors it saw last.
    """
    cache = layout_cache if layout_cache is not None else {}
    out = {}
    for key, t in tensors.items():
        if isinstance(t, LocalPart):
            out[key] = t
            continue
        shape = tuple(t.shape)
        planned = cache.get(key)
        if planned is None or planned.shape != shape:
            _, boxes = tensor_boxes(t)
            mine = bool(boxes) and _replica_choice(key, t, tensors)
            planned = cache[key] = _Planned(shape, [b for box in boxes for b in split_rows(box, t.element_size(), PIECE_BYTES)] if mine else [])
        local = _local_tensor(t)
        if planned.local is not local or planned.data_ptr != local.data_ptr():
            planned.local, planned.data_ptr = local, local.data_ptr()
            planned.views = [(b, local_view(local, b)) for b in planned.boxes]
            planned.raws = [piece_bytes(view) for _, view in planned.views]
        out[key] = LocalPart(shape, t.dtype, list(planned.views), planned.raws)
    return out


class SnapshotPool:
    """Snapshot buffers kept between saves, by (shape, dtype, pinned): a snapshot into them is a plain copy into warm memory.

    `snapshot(tensors, pool=...)` takes every buffer it needs from the pool;
    its buffers are the pool's for the next snapshot, which must not start
    until this one is written (`BackgroundWriter` waits for the save in flight
    first). Buffers the next snapshot does not take are dropped.
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._used: dict[tuple, list[torch.Tensor]] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        key = (tuple(shape), dtype, pinned)
        free = self._free.get(key)
        buf = free.pop() if free else torch.empty(shape, dtype=dtype, pin_memory=pinned)
        self._used.setdefault(key, []).append(buf)
        return buf

    def recycle(self) -> None:
        """The buffers taken since the last call become the free ones; buffers nobody took are dropped."""
        self._free, self._used = self._used, {}


def snapshot(tensors: dict[str, torch.Tensor], *, pool: SnapshotPool | None = None, layout_cache: dict | None = None,
             ready: "torch.cuda.Event | None" = None) -> dict[str, LocalPart]:
    """A CPU copy of what this rank will write (pinned when the data is on a GPU).

    Training may change the live tensors as soon as this returns; a
    `write_shards` of the snapshot can then run in a background thread. With a
    `pool`, the copies go into the buffers of the pool's previous snapshot
    (which must be written by now) and this snapshot's buffers become the pool.
    Called on a thread other than the training thread, pass `ready`: the
    training thread's `compute_done(tensors)`, taken when the state was whole;
    an event taken here would also wait for whatever training queued since.
    """
    return copy_pieces(plan_writes(tensors, layout_cache), pool=pool, ready=ready if ready is not None else compute_done(tensors))


def compute_done(tensors: dict[str, torch.Tensor]) -> "torch.cuda.Event | None":
    """On a GPU, an event on the current stream after the work queued so far (the optimizer step); None on CPU.

    Taken on the training thread, it lets `copy_pieces` copy on a side stream
    from another thread without reading state the queued kernels still write.
    """
    for t in tensors.values():
        if isinstance(t, torch.Tensor) and t.is_cuda:  # a DTensor has its local tensor's device: no `to_local` per tensor
            return torch.cuda.current_stream(t.device).record_event()
    return None


def copy_pieces(plan: dict[str, LocalPart], *, pool: SnapshotPool | None = None, ready: "torch.cuda.Event | None" = None) -> dict[str, LocalPart]:
    """Replace the planned pieces' views of the live tensors by CPU copies; returns `plan`.

    Safe on a thread other than the training thread while training runs its
    forward and backward, which read the state but do not change it; training
    must not step the optimizer until this returns. GPU pieces are copied on a
    side stream that first waits for `ready` (see `compute_done`), into pinned
    buffers, so the copy overlaps the training stream's compute.
    """
    stream = None
    for part in plan.values():
        copies = []
        for box, data in part.pieces:
            data = data.detach()
            pinned = data.is_cuda
            if pinned and stream is None:
                stream = torch.cuda.Stream(device=data.device)
                if ready is not None:
                    stream.wait_event(ready)
            buf = torch.empty(data.shape, dtype=data.dtype, pin_memory=pinned) if pool is None else pool.take(tuple(data.shape), data.dtype, pinned)
            if pinned:
                with torch.cuda.stream(stream):
                    buf.copy_(data, non_blocking=True)
            else:
                buf.copy_(data)
            copies.append((box, buf))
        part.pieces, part.raws = copies, None
    if stream is not None:
        stream.synchronize()
    if pool is not None:
        pool.recycle()
    return plan
