"""Layout-independent sharded checkpoints: any layout saves, any layout loads, bit-exact and verified.

A checkpoint is a directory (or object prefix) `step_NNNNNNNN/` of raw data
files (one per writing rank), an Arrow index with one row per stored piece in
global coordinates, and `manifest.json`, written last: the commit. See
`storage.format` for the layout on disk and the chain of checksums.

    tensors = state_tensors(model_parts, optimizer)        # live, named by FQN
    with Lease(uri, {"job": name}):                         # one job per URI (LeaseHeld names the holder)
        rows = write_shards(uri, step, rank, snapshot(tensors), generation=g)  # every rank, no communication
        commit(uri, step, all_rows, generation=g, layout=..., train_state=...)  # the coordinator, once
    load_training_state(uri, step, new_parts, new_optimizer)  # any layout
    # = load_shards(uri, step, state_tensors(new_parts, new_optimizer))
    planner = ReadPlanner.open(uri, step)                  # decode the index once, plan many ranks
    load_into(uri, step, {key: (shape, local, boxes)}, planner=planner)  # any rank, no DTensor needed
    load_pretrained(hf_dir, new_parts)                     # safetensors weights, each rank its slices
    export_checkpoint(uri, step, out_dir)                  # model weights as safetensors shards + index

No pickle is read or written anywhere: loading a checkpoint cannot execute code.
"""

import importlib

_HOMES = {
    "storage.catalog": ("check_writable", "clean_incomplete", "commit", "corrupt_newest", "latest_valid",
                        "list_checkpoints", "read_manifest", "remove_all", "retain", "verify"),
    "storage.format": ("CheckpointError",),
    "storage.lease": ("Lease", "LeaseHeld"),
    "storage.reader": ("ReadPlanner", "load_into", "load_shards", "load_training_state"),
    "storage.safetensors": ("SafetensorsDir", "export_checkpoint", "load_pretrained"),
    "storage.state": ("LocalPart", "compute_done", "snapshot", "state_tensors"),
    "storage.writer": ("BackgroundWriter", "gather_and_commit", "plan_copy", "rows_json", "write_shards"),
}
"""Where each name of the package's API lives. It is imported on first use (PEP 562): the node agent reads, writes and
commits checkpoints (`storage.format`, `storage.catalog`) in a process that never imports torch, which the reader
and the writer do (2-3 s of CPU for each agent a job starts, on the cores its ranks start on)."""
_HOME = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # the next lookup finds it directly
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_HOME))


__all__ = sorted(_HOME)
