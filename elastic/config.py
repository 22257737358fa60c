"""The job config: one typed, validated pydantic model loaded from YAML.

Every section forbids unknown keys, so a typo in a YAML file is an error that
names the field instead of a silently ignored setting.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and the reason."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    vocab_size: int = Field(64, ge=2, description="Number of token ids. Built-in transformer only.")
    dim: int = Field(64, ge=1, description="Hidden size. Built-in transformer only.")
    n_layers: int = Field(2, ge=1, description="Number of transformer blocks. Built-in transformer only.")
    n_heads: int = Field(4, ge=1, description="Attention heads; dim must divide by it. Built-in transformer only.")
    ffn_dim: int = Field(128, ge=1, description="Hidden size of the MLP. Built-in transformer only.")
    max_seq_len: int = Field(32, ge=2, description="Longest sequence it takes (data.seq_len at most). Built-in transformer only.")
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
    """The deterministic synthetic token dataset."""

    kind: Literal["synthetic"] = Field("synthetic", description="Only the built-in synthetic data for now.")
    num_samples: int = Field(1 << 20, ge=1, description="Samples in one epoch; the order is reshuffled each epoch.")
    seq_len: int = Field(16, ge=2, description="Tokens per sample (inputs and shifted labels come from seq_len + 1 tokens).")
    seed: int = Field(1234, description="Seed of the data and of the sample order.")


class ParallelConfig(_Section):
    """The parallel layout. `dp_shard: -1` means: whatever the world size leaves."""

    pp: int = Field(1, ge=1, description="Pipeline stages.")
    dp_replicate: int = Field(1, ge=1, description="Replica groups of HSDP (replicated across, sharded within).")
    dp_shard: int = Field(-1, description="FSDP shard degree; -1 fills the rest of the world size.")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (innermost axis, kept on one node).")
    sequence_parallel: bool = Field(True, description="Shard norm and dropout regions along the sequence when tp > 1.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field("1f1b", description="Pipeline schedule.")
    pp_microbatches: int = Field(0, ge=0, description="Pipeline micro-batches per step; 0 means pp (or 2*pp for interleaved).")
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

    num_workers: int = Field(4, ge=1, description="Workers (ranks) to start with.")
    min_workers: int = Field(1, ge=1, description="The job waits (then fails) below this many workers.")
    max_workers: int = Field(0, ge=0, description="The job grows back up to this many; 0 means num_workers.")
    workers_per_node: int = Field(0, ge=0, description="Simulated nodes of the embedded Ray hold this many workers each; 0 means one node. One node runs its workers on the head unless node faults need a node to remove.")
    cpus_per_worker: float = Field(1.0, gt=0, description="Ray CPUs reserved per worker.")
    gpus_per_worker: float = Field(0.0, ge=0, description="Ray GPUs per worker; > 0 selects CUDA and NCCL.")
    wait_for_workers_s: float = Field(30.0, ge=0, description="How long to wait for min_workers before failing.")

    @model_validator(mode="after")
    def _bounds(self) -> "ScalingConfig":
        if self.min_workers > self.num_workers:
            raise ValueError(f"scaling.min_workers ({self.min_workers}) exceeds scaling.num_workers ({self.num_workers})")
        if self.max_workers and self.max_workers < self.num_workers:
            raise ValueError(f"scaling.max_workers ({self.max_workers}) is below scaling.num_workers ({self.num_workers})")
        return self

    @property
    def upper(self) -> int:
        return self.max_workers or self.num_workers


class TrainingConfig(_Section):
    """The optimisation: fixed global batch, AdamW, linear warm-up then the chosen learning-rate schedule."""

    global_batch: int = Field(32, ge=1, description="Samples per optimizer step, whatever the world size.")
    micro_batch: int = Field(4, ge=1, description="Samples per forward/backward on one data-parallel rank.")
    steps: int = Field(200, ge=1, description="Optimizer steps to run.")
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
    seed: int = Field(0, description="Seed of the model's initial weights.")

    @model_validator(mode="after")
    def _betas(self) -> "TrainingConfig":
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"training.betas {list(self.betas)} must each be in [0, 1)")
        return self


class CheckpointConfig(_Section):
    """Where and how often checkpoints are written."""

    uri: str = Field("", description="Directory or fsspec URI (file://, memory://, s3://) of the checkpoints; empty means <run_root>/<name>/checkpoints.")
    every_steps: int = Field(20, ge=1, description="Save after every this many steps.")
    keep: int = Field(3, ge=1, description="Committed checkpoints to keep; older ones are deleted.")
    async_save: bool = Field(False, description="Write in the background while training continues.")
    resume: bool = Field(True, description="Resume from the newest committed checkpoint at start.")

    @model_validator(mode="after")
    def _uri_safe(self) -> "CheckpointConfig":
        if ".." in Path(re.sub(r"^[a-z0-9]+://", "", self.uri)).parts:
            raise ValueError(f"checkpoint.uri {self.uri!r} must not contain '..'")
        return self


class FaultConfig(_Section):
    """Failure detection and recovery policy."""

    max_failures: int = Field(5, ge=0, description="Failures tolerated before the job fails.")
    heartbeat_s: float = Field(0.2, gt=0, description="How often the controller polls worker liveness and progress.")
    hang_timeout_s: float = Field(0.0, ge=0, description="Explicit progress deadline; 0 calibrates it from step times.")
    hang_factor: float = Field(5.0, ge=1, description="Deadline = factor x slowest observed step after warm-up.")
    hang_floor_s: float = Field(5.0, gt=0, description="The calibrated deadline is never below this.")
    startup_timeout_s: float = Field(120.0, gt=0, description="Budget for start-up and the first step.")
    checkpoint_timeout_s: float = Field(120.0, gt=0, description="Budget for one checkpoint save.")
    grad_spike_factor: float = Field(
        10.0, ge=0, description="Warn (a `warning` event) when the global grad norm exceeds this many times its recent median; 0 disables."
    )
    grad_spike_window: int = Field(20, ge=1, description="Recent steps whose median grad norm the spike rule compares against.")
    grad_spike_warmup: int = Field(10, ge=1, description="Steps observed before the spike rule judges any.")
    inject: list[str] = Field(default_factory=list, description="Fault injection specs, as --inject takes them.")

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
        if self.training.global_batch % self.training.micro_batch:
            raise ValueError(
                f"training.global_batch ({self.training.global_batch}) must be divisible by training.micro_batch ({self.training.micro_batch})"
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


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def _set_dotted(data: dict, dotted: str, raw: str) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {key} is not a section")
    node[keys[-1]] = yaml.safe_load(raw)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, data: dict | None = None) -> JobConfig:
    """Load a JobConfig from YAML (or a dict) with `key.sub=value` overrides.

    Raises ConfigError with a one-line message naming the field on any
    problem, including what keeps the model from running at the configured
    layout (`elastic.recipe.check_model`).
    """
    raw: Any = dict(data or {})
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark else ""
            raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
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
