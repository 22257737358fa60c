"""The job config: one typed, validated pydantic model loaded from YAML.

Every section forbids unknown keys, so a typo in a YAML file is an error that
names the field (and the nearest valid one) instead of a silently ignored
setting. Every float must be finite and every integer must fit in 64 bits
(what torch and numpy store it in); sizes that cannot work on any machine
have an upper bound (the `MAX_*` constants below), named in the error. An
integer written in exponent notation (`1e6`, which YAML reads as a string)
is the number it spells, when it spells a whole one.
`load_config` turns every problem into one `ConfigError` line naming the field.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import re
from decimal import Decimal
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from elastic.faults import FaultSpecError, parse_faults

INT64_MAX = 2**63 - 1
"""Every integer field fits in an int64: torch and numpy hold it in one, and a seed beyond it overflows."""
MAX_SAMPLES = 1 << 27
"""data.num_samples: the controller and every rank hold a permutation of an epoch's sample ids (int64), 1 GiB at this size."""
MAX_WORKERS = 1 << 16
"""scaling.num_workers / max_workers: far beyond any job this manager has run (1024 ranks are simulated in the tests)."""
MAX_SIMULATED_NODES = 32
"""Nodes the embedded Ray may simulate on one machine (num_workers / workers_per_node): each is a raylet and its agents.
Checked only where a job starts the embedded Ray (`elastic.job`): a real cluster has real nodes, as many as it has."""
MIN_CPUS = 0.01
"""The smallest Ray CPU share a worker may reserve; below it a worker would hold nothing and Ray packs any number on a core."""
MAX_SECONDS = 7 * 24 * 3600.0
"""Durations and timeouts: a week; beyond it a deadline is no deadline (and sleeping that long overflows)."""
MAX_STEPS = 10**8
"""training.steps: years of training at a step a second; the controller keeps every step's loss, and the report lists them."""
MAX_KEEP = 1000
"""checkpoint.keep: after every commit, retention verifies (manifest, index, file sizes) up to this many checkpoints."""
MAX_MICROBATCHES = 1 << 14
"""parallel.pp_microbatches: each splits a rank's batch (a sample at least), and every rank's schedule holds an action per micro-batch and stage."""
MAX_SPIKE_WINDOW = 10_000
"""fault.grad_spike_window: the grad-spike rule takes the median of the window at every step."""


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and the reason."""


_EXPONENT_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")
"""A number in exponent notation that YAML 1.1 reads as a string (`1e12`: no dot, no sign after the e)."""


def _takes_int(annotation: Any) -> bool:
    """Whether a field holds an integer (`int` or `int | None`)."""
    return annotation is int or (get_origin(annotation) in (Union, UnionType) and int in get_args(annotation))


def _exponent_int(text: str) -> Any:
    """The integer an exponent-notation string spells (`1e12` -> 10**12), for an integer field; ValueError if it spells no whole number.

    Exact (decimal, not float), and refused before an absurd exponent could build a huge integer.
    """
    number = Decimal(text)
    if number and number.adjusted() > 18:
        raise ValueError(f"must fit in 64 bits (between -{INT64_MAX} and {INT64_MAX}), got {text!r}")
    if number != number.to_integral_value():
        raise ValueError(f"must be a whole number, got {text!r}")
    return int(number)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _exponent_notation(cls, value: Any, info: ValidationInfo) -> Any:
        """`data.num_samples=1e12` means the number: YAML reads it as a string, which an integer field would refuse as unparsable."""
        if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()) and _takes_int(cls.model_fields[info.field_name].annotation):
            return _exponent_int(value.strip())
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _fits_int64(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
            raise ValueError(f"must fit in 64 bits (between -{INT64_MAX} and {INT64_MAX})")
        return value


def _no_control_characters(field: str, path: str) -> None:
    """A path with a NUL or newline cannot be opened (and would break the one-line error naming it)."""
    bad = next((c for c in path if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ValueError(f"{field} must not contain control characters, found {bad!r}")


BUILTIN_BUILDER = "elastic.model:transformer"
BUILTIN_SHAPE = ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len", "norm_eps")
"""The fields that shape the built-in transformer: its builder's arguments."""


class ModelConfig(_Section):
    """The model: a builder named by import path and its arguments (default: the built-in transformer)."""

    builder: str = Field(
        BUILTIN_BUILDER,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$",
        description="`package.module:function` that returns `(module, ModelSpec)`, the module built on the meta device; "
        "imported on every rank with the job's working directory on the import path. Default: the built-in transformer, "
        "shaped by the fields below.",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the builder (not for the built-in transformer, which takes the fields below).")
    init_from: str = Field(
        "",
        description="Directory of `*.safetensors` weights (local or any fsspec URI; with or without `model.safetensors.index.json`) "
        "that a job starts from when it resumes no checkpoint; each rank reads only its slices. Empty: the model's seeded initialiser.",
    )
    vocab_size: int = Field(64, ge=2, le=1 << 22, description="Number of token ids. Built-in transformer only.")
    dim: int = Field(64, ge=1, le=1 << 16, description="Hidden size. Built-in transformer only.")
    n_layers: int = Field(2, ge=1, le=1024, description="Number of transformer blocks. Built-in transformer only.")
    n_heads: int = Field(4, ge=1, le=1024, description="Attention heads; dim must divide by it. Built-in transformer only.")
    ffn_dim: int = Field(128, ge=1, le=1 << 18, description="Hidden size of the MLP. Built-in transformer only.")
    max_seq_len: int = Field(32, ge=2, le=1 << 20, description="Longest sequence it takes (data.seq_len at most). Built-in transformer only.")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon of the RMS norms. Built-in transformer only.")

    @model_validator(mode="after")
    def _builder_and_shape(self) -> "ModelConfig":
        if self.builder != BUILTIN_BUILDER:
            shaped = [f for f in BUILTIN_SHAPE if getattr(self, f) != type(self).model_fields[f].default]
            if shaped:
                raise ValueError(f"model.{shaped[0]} shapes the built-in transformer only; give the arguments of {self.builder} in model.args")
            return self
        if self.args:
            raise ValueError(f"model.args: the built-in transformer takes model.{', model.'.join(BUILTIN_SHAPE)} instead")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        return self

    def builder_args(self) -> dict[str, Any]:
        """The keyword arguments the builder is called with."""
        return {f: getattr(self, f) for f in BUILTIN_SHAPE} if self.builder == BUILTIN_BUILDER else dict(self.args)


class DataConfig(_Section):
    """What the job trains on: synthetic tokens, a tokenized corpus, or a dataset plug-in; and its held-out split.

    `tokens` packs the corpus into windows of seq_len + 1 tokens: every file's
    documents in order (files sorted by path), each followed by `eos_token`
    when set, form one token stream; window i is tokens [i*seq_len, i*seq_len
    + seq_len + 1) of it (neighbours share one token, so every token but the
    first is a label once); the tail too short for a window is dropped.
    """

    kind: Literal["synthetic", "tokens", "builder"] = Field(
        "synthetic", description="synthetic: the built-in arithmetic tokens; tokens: a tokenized corpus at data.path; builder: the dataset data.builder returns."
    )
    path: str = Field("", description="tokens: a file, a directory or a glob of .parquet, .arrow or .bin files; local or any fsspec URI (s3://...).")
    column: str = Field("input_ids", min_length=1, description="tokens: the list-of-integers column of Parquet and Arrow files (one row is one document).")
    dtype: Literal["uint16", "uint32"] = Field("uint16", description="tokens: the integer type of flat .bin token files.")
    eos_token: int | None = Field(None, ge=0, description="tokens: a token appended after each Parquet/Arrow row (document) when packing; .bin files hold their separators already.")
    cache_mb: int = Field(256, ge=0, le=1 << 20, description="tokens: decoded Parquet row groups and remote Arrow batches a rank keeps (LRU, MiB).")
    builder: str = Field("", description="builder: 'package.module:function' returning a map-style dataset (len, [index] -> (inputs, labels) tensors of seq_len).")
    args: dict[str, Any] = Field(default_factory=dict, description="builder: keyword arguments of data.builder.")
    num_samples: int | None = Field(
        None, ge=1, le=MAX_SAMPLES,
        description="Training samples in one epoch (the order is reshuffled each epoch). Synthetic: 1048576 if unset. tokens/builder: all the corpus's windows (less the eval split) if unset; a smaller number uses only the first ones. At most 2^27: the controller and each rank hold the epoch's permutation (8 bytes a sample).",
    )
    seq_len: int = Field(16, ge=2, description="Tokens per sample (inputs and shifted labels come from seq_len + 1 tokens).")
    seed: int = Field(1234, ge=0, description="Seed of the data and of the sample order.")
    eval_samples: int = Field(
        0, ge=0, le=MAX_SAMPLES, description="Held-out samples: without data.eval_path, the corpus's last windows (synthetic: the indices after num_samples); with it, at most this many of its windows (0: all). Evaluation runs whole global batches: the first floor(n / global_batch) * global_batch of them."
    )
    eval_path: str = Field("", description="tokens: a separate held-out corpus (same format settings as data.path).")

    @model_validator(mode="after")
    def _kind_fields(self) -> "DataConfig":
        if self.kind == "tokens" and not self.path:
            raise ValueError("data.path is required with data.kind: tokens")
        if self.kind == "builder" and not self.builder:
            raise ValueError("data.builder is required with data.kind: builder ('package.module:function')")
        if self.builder and self.kind != "builder":
            raise ValueError(f"data.builder is set but data.kind is {self.kind}: use data.kind: builder")
        if self.builder and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.builder):
            raise ValueError(f"data.builder {self.builder!r} must be 'package.module:function'")
        if self.path and self.kind != "tokens":
            raise ValueError(f"data.path is set but data.kind is {self.kind}: use data.kind: tokens")
        if self.eval_path and self.kind != "tokens":
            raise ValueError("data.eval_path needs data.kind: tokens")
        return self


class ParallelConfig(_Section):
    """The parallel layout. `dp_shard: -1` means: whatever the world size leaves."""

    pp: int = Field(1, ge=1, description="Pipeline stages.")
    dp_replicate: int = Field(1, ge=1, description="Replica groups of HSDP (replicated across, sharded within).")
    dp_shard: int = Field(
        -1,
        description="FSDP shard degree; -1 fills the rest of the world size. A positive value is the degree at scaling.num_workers: "
        "pp x dp_replicate x dp_shard x tp must equal it (else the config is refused); a resize re-derives it from the workers left.",
    )
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (innermost axis, kept on one node).")
    sequence_parallel: bool = Field(True, description="Shard norm and dropout regions along the sequence when tp > 1.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field("1f1b", description="Pipeline schedule.")
    pp_microbatches: int = Field(0, ge=0, le=MAX_MICROBATCHES, description="Pipeline micro-batches per step; 0 means pp (or 2*pp for interleaved).")
    pp_virtual_stages: int = Field(2, ge=1, description="Stages per rank for interleaved_1f1b.")
    reshard_after_forward: bool = Field(True, description="FSDP frees gathered parameters after forward (ZeRO-3) or keeps them (ZeRO-2).")
    activation_checkpointing: bool = Field(False, description="Recompute each block's activations in backward.")

    @model_validator(mode="after")
    def _dp_shard_valid(self) -> "ParallelConfig":
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ValueError("parallel.dp_shard must be a positive degree or -1 (fill the world size)")
        return self


class ScalingConfig(_Section):
    """How many workers the job may use and how they are placed."""

    num_workers: int = Field(4, ge=1, le=MAX_WORKERS, description="Workers (ranks) to start with.")
    min_workers: int = Field(1, ge=1, description="The job waits (then fails) below this many workers.")
    max_workers: int = Field(0, ge=0, le=MAX_WORKERS, description="The job grows back up to this many; 0 means num_workers.")
    workers_per_node: int = Field(
        0, ge=0,
        description="Simulated nodes of the embedded Ray hold this many workers each; 0 means one node. One node runs its workers on the head "
        f"unless node faults need a node to remove. At most {MAX_SIMULATED_NODES} simulated nodes (num_workers / workers_per_node) on one machine; "
        "on a real Ray cluster (--address, RAY_ADDRESS) it is the workers each node holds, and any number of nodes is fine.",
    )
    cpus_per_worker: float = Field(1.0, ge=MIN_CPUS, le=1024, description="Ray CPUs reserved per worker.")
    gpus_per_worker: float = Field(0.0, ge=0, le=16, description="Ray GPUs per worker (0, or at least 0.01); > 0 selects CUDA and NCCL.")
    wait_for_workers_s: float = Field(30.0, ge=0, le=MAX_SECONDS, description="How long to wait for min_workers before failing.")

    @model_validator(mode="after")
    def _bounds(self) -> "ScalingConfig":
        if self.min_workers > self.num_workers:
            raise ValueError(f"scaling.min_workers ({self.min_workers}) exceeds scaling.num_workers ({self.num_workers})")
        if self.max_workers and self.max_workers < self.num_workers:
            raise ValueError(f"scaling.max_workers ({self.max_workers}) is below scaling.num_workers ({self.num_workers})")
        if 0 < self.gpus_per_worker < 0.01:
            raise ValueError(f"scaling.gpus_per_worker ({self.gpus_per_worker}) must be 0 or at least 0.01")
        return self

    @property
    def upper(self) -> int:
        return self.max_workers or self.num_workers

    @property
    def nodes(self) -> int:
        """Nodes the job starts on: num_workers / workers_per_node, rounded up (1 when workers_per_node is 0)."""
        return math.ceil(self.num_workers / self.workers_per_node) if self.workers_per_node else 1


class TrainingConfig(_Section):
    """The optimisation: fixed global batch, AdamW, linear warm-up then the chosen learning-rate schedule."""

    global_batch: int = Field(32, ge=1, le=1 << 20, description="Samples per optimizer step, whatever the world size.")
    micro_batch: int = Field(4, ge=1, description="Samples per forward/backward on one data-parallel rank.")
    steps: int = Field(200, ge=1, le=MAX_STEPS, description="Optimizer steps to run.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps.")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine",
        description="After the warm-up: cosine or linear decay to min_lr_ratio x lr at the last step, constant at lr, "
        "or wsd (stable at lr, then linear decay to min_lr_ratio x lr over the last decay_fraction of the steps).",
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Where the decaying schedules end, as a fraction of lr.")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: the share of the steps, at the end, over which the rate decays.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW coefficients of the running averages of the gradient and its square.")
    eps: float = Field(1e-8, gt=0, description="AdamW term added to the denominator.")
    optimizer_impl: Literal["foreach", "fused", "for_loop"] = Field(
        "foreach", description="AdamW implementation: foreach (batched), fused (one kernel) or for_loop; the same update up to rounding."
    )
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables clipping.")
    seed: int = Field(0, ge=0, description="Seed of the model's initial weights.")
    eval_every: int = Field(0, ge=0, description="Evaluate the held-out split (data.eval_samples / data.eval_path) every this many steps and at the end; 0 disables.")

    @model_validator(mode="after")
    def _betas(self) -> "TrainingConfig":
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"training.betas {list(self.betas)} must each be in [0, 1)")
        return self


class CheckpointConfig(_Section):
    """Where and how often checkpoints are written."""

    uri: str = Field("", description="Directory or fsspec URI (file://, memory://, s3://) of the checkpoints; empty means <run_root>/<name>/checkpoints.")
    every_steps: int = Field(20, ge=1, description="Save after every this many steps.")
    keep: int = Field(3, ge=1, le=MAX_KEEP, description="Committed checkpoints to keep; older ones are deleted.")
    async_save: bool = Field(False, description="Write in the background while training continues.")
    resume: bool = Field(True, description="Resume from the newest committed checkpoint at start.")
    commit_timeout_s: float = Field(
        300.0, gt=0, description="A commit (index, manifest, retention) that takes longer is abandoned, fenced and reported: a dead mount never wedges the controller. "
        "The recovery path's storage work (finding the restore point) has the same deadline; past it the job goes on as if no checkpoint were reachable."
    )
    max_uncommitted_s: float = Field(
        1800.0, ge=0, description="Fail the job when commits have failed and none has succeeded for this long; 0 never fails for that."
    )
    memory: bool = Field(
        False,
        description="Also keep a snapshot of the training state in node memory every memory_every_steps steps (the memory tier): "
        "a failure then costs at most about one step instead of the steps since the last durable checkpoint.",
    )
    memory_every_steps: int = Field(1, ge=1, description="With memory: snapshot into node memory after every this many steps.")
    memory_replicas: int = Field(
        1, ge=0, le=1, description="With memory: copies of each node's snapshot kept on another node (0 or 1); 1 survives the loss of a whole node."
    )
    memory_dir: str = Field(
        "", description="With memory: the node-local directory the snapshots live in, on a RAM-backed filesystem; empty means /dev/shm "
        "(or the temporary directory where there is none). It must hold 2 x this node's ranks' share of the training state, and as "
        "much again for the share it keeps for another node (memory_replicas: 1).",
    )
    memory_replica_timeout_s: float = Field(
        30.0, gt=0, le=MAX_SECONDS,
        description="With memory: how long a rank waits, before its next optimizer step, for its snapshot's replica to be in place; "
        "after that it trains on and the step has no replica.",
    )

    @model_validator(mode="after")
    def _uri_safe(self) -> "CheckpointConfig":
        _no_control_characters("checkpoint.uri", self.uri)
        _no_control_characters("checkpoint.memory_dir", self.memory_dir)
        if ".." in Path(re.sub(r"^[a-z0-9]+://", "", self.uri)).parts:
            raise ValueError(f"checkpoint.uri {self.uri!r} must not contain '..'")
        return self


class FaultConfig(_Section):
    """Failure detection and recovery policy."""

    max_failures: int = Field(5, ge=0, description="Failures tolerated before the job fails.")
    heartbeat_s: float = Field(0.2, ge=0.001, le=60, description="How often the controller polls worker liveness and progress.")
    hang_timeout_s: float = Field(0.0, ge=0, le=MAX_SECONDS, description="Explicit progress deadline; 0 calibrates it from step times.")
    hang_factor: float = Field(5.0, ge=1, le=1000, description="Deadline = factor x slowest observed step after warm-up.")
    hang_floor_s: float = Field(5.0, gt=0, le=MAX_SECONDS, description="The calibrated deadline is never below this.")
    startup_timeout_s: float = Field(120.0, gt=0, le=MAX_SECONDS, description="Budget for start-up and the first step.")
    checkpoint_timeout_s: float = Field(120.0, gt=0, le=MAX_SECONDS, description="Budget for one checkpoint save.")
    grad_spike_factor: float = Field(
        10.0, ge=0, description="Warn (a `warning` event) when the global grad norm exceeds this many times its recent median; 0 disables."
    )
    grad_spike_window: int = Field(20, ge=1, le=MAX_SPIKE_WINDOW, description="Recent steps whose median grad norm the spike rule compares against.")
    grad_spike_warmup: int = Field(10, ge=1, description="Steps observed before the spike rule judges any.")
    inject: list[str] = Field(
        default_factory=list,
        description="Fault injection specs, as --inject takes them (a YAML list of strings). A spec whose fault can never fire "
        "(a rank no layout of the job has, a step past training.steps) is refused when the job is checked.",
    )

    @field_validator("inject")
    @classmethod
    def _specs_parse(cls, specs: list[str]) -> list[str]:
        try:
            parse_faults(specs)
        except FaultSpecError as exc:
            raise ValueError(str(exc)) from None
        return specs

    @model_validator(mode="after")
    def _spike_factor(self) -> "FaultConfig":
        if 0 < self.grad_spike_factor <= 1:
            raise ValueError(f"fault.grad_spike_factor ({self.grad_spike_factor}) must be 0 (off) or above 1")
        return self


class JobConfig(_Section):
    """A whole elastic training job."""

    name: str = Field("job", pattern=r"^[A-Za-z0-9_.-]+$", description="Job name; names the run directory.")
    run_root: str = Field("runs", description="Root folder of run directories (events.jsonl, report.json).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks cuda when workers get GPUs.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "JobConfig":
        if set(self.name) <= {"."}:
            raise ValueError(f"name {self.name!r} would put the run directory outside run_root")
        _no_control_characters("run_root", self.run_root)
        p = self.parallel
        if p.dp_shard > 0 and p.pp * p.dp_replicate * p.dp_shard * p.tp != self.scaling.num_workers:
            raise ValueError(
                f"parallel.dp_shard ({p.dp_shard}): pp x dp_replicate x dp_shard x tp = {p.pp * p.dp_replicate * p.dp_shard * p.tp} ranks, "
                f"not scaling.num_workers ({self.scaling.num_workers}); set parallel.dp_shard to -1 to use every worker"
            )
        if self.training.global_batch % self.training.micro_batch:
            raise ValueError(
                f"training.global_batch ({self.training.global_batch}) must be divisible by training.micro_batch ({self.training.micro_batch})"
            )
        if self.training.eval_every and not (self.data.eval_samples or self.data.eval_path):
            raise ValueError("training.eval_every needs a held-out split: set data.eval_samples or data.eval_path")
        if self.training.eval_every and 0 < self.data.eval_samples < self.training.global_batch:
            raise ValueError(
                f"data.eval_samples ({self.data.eval_samples}) is fewer than one training.global_batch ({self.training.global_batch}): evaluation runs whole global batches"
            )
        wpn = self.scaling.workers_per_node
        if self.parallel.tp > 1 and wpn and wpn % self.parallel.tp:
            raise ValueError(
                f"scaling.workers_per_node ({wpn}) must be a multiple of parallel.tp ({self.parallel.tp}): a TP group stays on one node"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run_root) / self.name

    @property
    def checkpoint_uri(self) -> str:
        """Where this job's checkpoints live (the run directory's `checkpoints/` unless configured)."""
        return self.checkpoint.uri or str(self.run_dir / "checkpoints")


def _section_fields(loc: tuple) -> list[str]:
    """The field names of the section at `loc` (() is the top level), or [] where `loc` is no section."""
    model: type[BaseModel] = JobConfig
    for part in loc:
        info = model.model_fields.get(part) if isinstance(part, str) else None
        section = info.annotation if info else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return []
        model = section
    return list(model.model_fields)


def _did_you_mean(loc: tuple) -> str:
    """`; did you mean X?` for an unknown field: the nearest field of its section, or the section that has a field of that name."""
    name = str(loc[-1])
    close = difflib.get_close_matches(name, _section_fields(loc[:-1]), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {'.'.join(map(str, (*loc[:-1], close[0])))}?"
    homes = [f"{section}.{name}" for section in _section_fields(()) if name in _section_fields((section,))]
    return f"; did you mean {' or '.join(homes)}?" if homes else ""


def _format_error(err: ValidationError) -> str:
    """One line naming the field: pydantic's first error, with a hint where a typical mistake is recognisable."""
    first = err.errors()[0]
    loc = tuple(first["loc"])
    where = ".".join(str(p) for p in loc)
    given = first.get("input")
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown field" + _did_you_mean(loc)
    elif first["type"] == "list_type" and isinstance(given, str):
        example = json.dumps([given])
        msg = f"expected a YAML list, got the string {given!r}; write {example} (on the command line: --set '{where}={example}')"
    elif first["type"] not in ("value_error", "assertion_error") and isinstance(given, (int, float, str)) and len(repr(given)) <= 60:
        msg += f" (got {given!r})"
    named = msg.startswith((f"{where}.", f"{where} "))  # a section's own check names its fields
    line = f"{where}: {msg}" if where and not named else msg
    return " ".join(line.splitlines())


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last one without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the safe loader itself refuses it below
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong, and on which line, in one line."""
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"invalid YAML{where}: {problem}"


def _set_dotted(data: dict, dotted: str, raw: str) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"--set {dotted}={raw}: {dotted!r} is not a field name (section.field)")
    try:
        value = _yaml(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{dotted}: the --set value {raw!r} is {_yaml_problem(exc)} (quote it to pass a string)") from None
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {key} is not a section")
    node[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, data: dict | None = None) -> JobConfig:
    """Load a JobConfig from YAML (or a dict) with `key.sub=value` overrides.

    Raises ConfigError with a one-line message naming the field on any
    problem, including what keeps the model from running at the configured
    layout (`elastic.recipe.check_model`).
    """
    raw: Any = copy.deepcopy(data or {})
    if path is not None:
        try:
            raw = _yaml(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read the config: {getattr(exc, 'strerror', None) or exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: {_yaml_problem(exc)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the config must be a mapping of sections")
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, value = item.split("=", 1)
        _set_dotted(raw, key.strip(), value)
    try:
        cfg = JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    from elastic.recipe import check_model  # builds the model on meta: torch and the builder's module

    check_model(cfg)
    return cfg
