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

from storage.catalog import (
    check_writable,
    clean_incomplete,
    corrupt_newest,
    latest_valid,
    list_checkpoints,
    read_manifest,
    remove_all,
    retain,
    verify,
)
from storage.format import CheckpointError
from storage.lease import Lease, LeaseHeld
from storage.reader import ReadPlanner, load_into, load_shards, load_training_state
from storage.safetensors import SafetensorsDir, export_checkpoint, load_pretrained
from storage.state import LocalPart, snapshot, state_tensors
from storage.writer import BackgroundWriter, commit, gather_and_commit, write_shards

__all__ = [
    "BackgroundWriter",
    "CheckpointError",
    "Lease",
    "LeaseHeld",
    "LocalPart",
    "ReadPlanner",
    "SafetensorsDir",
    "check_writable",
    "clean_incomplete",
    "commit",
    "corrupt_newest",
    "export_checkpoint",
    "gather_and_commit",
    "latest_valid",
    "list_checkpoints",
    "load_into",
    "load_pretrained",
    "load_shards",
    "load_training_state",
    "read_manifest",
    "remove_all",
    "retain",
    "snapshot",
    "state_tensors",
    "verify",
    "write_shards",
]
