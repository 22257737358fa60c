"""Safetensors weights in and out, a slice or a tensor at a time.

In: `load_pretrained(uri, model_parts)` fills a rank's parameters (plain
tensors or DTensor shards of any layout) from a directory of `*.safetensors`
files, local or any fsspec URI, with or without `model.safetensors.index.json`.
Each rank reads the file headers and then only the byte ranges of the slices
it owns: the format is an 8-byte little-endian header length, a JSON header
(dtype, shape and byte range of every tensor) and the raw row-major data, so a
slice of a tensor is a set of byte ranges. Nothing is memory-mapped or read
whole; no code is executed.

Out: `export_checkpoint(uri, step, out_dir)` writes the model weights of a
training checkpoint as sharded safetensors files plus the index, streaming:
one full tensor at a time is read (from any layout's pieces) and written.
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from storage.boxes import Box
from storage.format import CheckpointError
from storage.fs import Store
from storage.reader import ReadPlanner, load_into
from storage.state import local_view, tensor_boxes

INDEX = "model.safetensors.index.json"
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100 << 20
"""A header larger than this is taken for a corrupt file rather than read."""
MAX_RUNS = 4096
"""A slice that is more byte runs than this (a column slice of a tall matrix) is read as its whole rows instead."""
READERS = 8
"""Slices read at once (object stores answer many range requests concurrently)."""


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies: file, dtype, shape, and the absolute byte offset of its data."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def _header(store: Store, rel: str) -> dict[str, Entry]:
    where = store.describe(rel)
    head = bytearray(8)
    try:
        if store.read_into(rel, [(0, [head])])[0] != 8:
            raise CheckpointError(f"{where}: not a safetensors file (shorter than its header length)")
    except FileNotFoundError:
        raise CheckpointError(f"{where} is missing") from None
    (size,) = struct.unpack("<Q", head)
    if size > MAX_HEADER:
        raise CheckpointError(f"{where}: not a safetensors file (header length {size})")
    raw = bytearray(size)
    if store.read_into(rel, [(8, [raw])])[0] != size:
        raise CheckpointError(f"{where}: truncated header")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{where}: unreadable header: {exc}") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in DTYPES:
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {info.get('dtype')!r}, which is not supported")
        begin, end = info["data_offsets"]
        out[name] = Entry(rel, DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + begin, end - begin)
    return out


class SafetensorsDir:
    """The tensors of a directory of safetensors files: names, shapes, dtypes and byte ranges, from the headers alone."""

    def __init__(self, uri: str, *, storage_options: dict | None = None):
        self.uri = uri
        self.store = Store(uri, storage_options)
        if self.store.exists(INDEX):
            try:
                weight_map = json.loads(self.store.read(INDEX))["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{self.store.describe(INDEX)}: not a safetensors index ({exc})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = [f for f in self.store.list_files() if f.endswith(".safetensors")]
        if not files:
            raise CheckpointError(f"{uri}: no *.safetensors files")
        self.entries: dict[str, Entry] = {}
        for rel in files:
            self.entries.update(_header(self.store, rel))

    def match(self, shapes: dict[str, tuple[int, ...]], checkpoint_key: Callable[[str, frozenset], str] | None = None) -> dict[str, str]:
        """The tensor that fills each parameter (`fqn` -> name in the files); CheckpointError if one is missing or misshapen."""
        names = frozenset(self.entries)
        out, missing = {}, []
        for fqn, shape in shapes.items():
            key = checkpoint_key(fqn, names) if checkpoint_key is not None else fqn
            if key not in self.entries:
                missing.append(fqn if key == fqn else f"{fqn} (as {key})")
            elif self.entries[key].shape != tuple(shape):
                raise CheckpointError(f"{self.uri}: {key!r} is {list(self.entries[key].shape)} there, {list(shape)} in the model")
            out[fqn] = key
        if missing:
            raise CheckpointError(
                f"{self.uri}: no tensor for {len(missing)} parameters ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                f"it holds {len(names)} tensors ({', '.join(sorted(names)[:3])}, ...): map the names with ModelSpec.checkpoint_key"
            )
        return out

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The `box` of tensor `key` (global offsets and lengths), in its stored dtype, reading only its bytes.

        A box is a run of bytes per combination of its outer indices, up to its
        last partial dimension; past `MAX_RUNS` runs the whole rows it spans are
        read (one range) and cut here.
        """
        e = self.entries[key]
        shape, item = e.shape, e.dtype.itemsize
        out = torch.empty(box.lengths, dtype=e.dtype)
        if out.numel() == 0:
            return out
        partial = [d for d in range(len(shape)) if box.lengths[d] != shape[d]]
        last = partial[-1] if partial else 0
        inner = 1
        for size in shape[last + 1 :]:
            inner *= size
        run = box.lengths[last] * inner * item if shape else item
        outer = 1
        for length in box.lengths[:last]:
            outer *= length
        if outer > MAX_RUNS:
            rows = Box((box.offsets[0],) + (0,) * (len(shape) - 1), (box.lengths[0],) + shape[1:], box.local)
            whole = self.read(key, rows)
            for d in range(1, len(shape)):
                whole = whole.narrow(d, box.offsets[d], box.lengths[d])
            return out.copy_(whole)
        view = out.view(-1).view(torch.uint8).numpy()
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        requests = []
        for k in range(outer):
            element, rest = 0, k
            for d in range(last - 1, -1, -1):  # the outer multi-index of run k, last outer dim fastest
                rest, i = divmod(rest, box.lengths[d])
                element += (box.offsets[d] + i) * strides[d]
            element += (box.offsets[last] * strides[last]) if shape else 0
            requests.append((e.start + element * item, [view[k * run : (k + 1) * run]]))
        got = self.store.read_into(e.file, requests)
        if any(n != run for n in got):
            raise CheckpointError(f"{self.store.describe(e.file)}: truncated (tensor {key!r})")
        return out


def load_pretrained(
    uri: str,
    model_parts: list[nn.Module],
    *,
    checkpoint_key: Callable[[str, frozenset], str] | None = None,
    storage_options: dict | None = None,
) -> None:
    """Fill every parameter of `model_parts` (materialised, any layout) with its slices of the safetensors weights at `uri`.

    Parameter `fqn` reads tensor `checkpoint_key(fqn, names in the files)`
    (default: `fqn` itself). Every parameter must find a tensor of its shape;
    values are converted to the parameter's dtype.
    """
    src = SafetensorsDir(uri, storage_options=storage_options)
    params = {fqn: param for part in model_parts for fqn, param in part.named_parameters()}
    keys = src.match({fqn: tuple(p.shape) for fqn, p in params.items()}, checkpoint_key)
    jobs = []
    for fqn, param in params.items():
        local, boxes = tensor_boxes(param)
        jobs += [(keys[fqn], box, local_view(local.detach(), box)) for box in boxes]

    def fill(job) -> None:
        key, box, dest = job
        data = src.read(key, box)
        with torch.no_grad():
            dest.copy_(data)

    with ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="pretrained-read") as pool:
        list(pool.map(fill, jobs))


def _shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive names grouped into files of at most `max_bytes` (a larger tensor gets a file of its own)."""
    shards: list[list[str]] = []
    total = 0
    for name, nbytes in sizes:
        if not shards or (total + nbytes > max_bytes and shards[-1]):
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += nbytes
    return shards


def export_checkpoint(
    uri: str,
    step: int,
    out_dir: str,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 << 30,
    extra_files: dict[str, bytes] | None = None,
    storage_options: dict | None = None,
) -> dict:
    """Write the model weights (`model.*`, no optimizer state) of checkpoint `step` as safetensors shards plus the index.

    Tensors are named by their module FQN and written in name order, each
    read whole from the checkpoint (whatever layout saved it), converted to
    `dtype` if given, and streamed into its file: one tensor in memory at a
    time. `extra_files` (a model's `config.json`, ...) are written alongside.
    Returns the index.
    """
    planner = ReadPlanner.open(uri, step, storage_options=storage_options)
    metas = {}
    for key in planner.keys():
        if key.startswith("model."):
            shape, stored = planner.meta(key)
            metas[key.removeprefix("model.")] = (tuple(shape), stored, dtype or stored)
    if not metas:
        raise CheckpointError(f"{uri} step {step}: no model weights in the checkpoint")

    def nbytes(name: str) -> int:
        shape, _, out = metas[name]
        n = out.itemsize
        for size in shape:
            n *= size
        return n

    shards = _shards([(name, nbytes(name)) for name in sorted(metas)], max_shard_bytes)
    out = Store(out_dir)
    out.makedirs()
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        rel = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        pos = 0
        for name in names:
            shape, _, out_dtype = metas[name]
            header[name] = {"dtype": NAMES[out_dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes(name)]}
            pos += nbytes(name)
            weight_map[name] = rel
        total += pos
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)

        def stream(names=names, raw=raw):
            yield struct.pack("<Q", len(raw)) + raw
            for name in names:
                shape, stored, out_dtype = metas[name]
                full = torch.empty(shape, dtype=stored)
                load_into(uri, step, {f"model.{name}": (shape, full, [Box((0,) * len(shape), shape, (0,) * len(shape))])},
                          planner=planner, storage_options=storage_options)
                yield full.to(out_dtype).reshape(-1).view(torch.uint8).numpy()

        out.write(rel, stream())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    out.write(INDEX, [json.dumps(index, indent=2).encode()])
    for rel, data in (extra_files or {}).items():
        out.write(rel, [data])
    return index
