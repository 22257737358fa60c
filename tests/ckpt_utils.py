"""Read a whole checkpoint back as full (unsharded) tensors, for comparisons in tests."""

from __future__ import annotations

import torch

import storage
from storage.catalog import read_index
from storage.state import DTYPES
from storage.fs import Store


def full_tensors(uri: str, step: int) -> dict[str, torch.Tensor]:
    store = Store(uri)
    manifest = storage.read_manifest(uri, step)
    shapes = {p.key: (tuple(p.shape), p.dtype) for p in read_index(store, step, manifest)}
    template = {k: torch.empty(shape, dtype=DTYPES[dtype]) for k, (shape, dtype) in shapes.items()}
    storage.load_shards(uri, step, template)
    return template
