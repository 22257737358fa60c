"""The model side of a job: the builder named by import path, its checks, the initial weights, the optimizer.

A builder is a function `package.module:function` called with the keyword
arguments `model.args`; it returns `(module, ModelSpec)` with the module on
the meta device (it is called inside `torch.device("meta")`, so plain
construction is enough). The built-in transformer is `elastic.model:transformer`.
Ranks receive the import path and JSON arguments, never a pickled callable:
each imports the builder itself. The job's working directory (the driver's
current directory, which `ray job submit --working-dir` ships) is on the
import path of the driver and of every rank, so a builder next to the job
YAML is found everywhere.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
from typing import Callable

import torch
from torch import nn

import storage
from elastic.config import BUILTIN_BUILDER, ConfigError, JobConfig, ModelConfig, TrainingConfig
from strategies import ModelSpec, ParallelModel, init_weights
from strategies.compose import model_problems


@functools.cache
def working_dir() -> str:
    """The job's working directory: the driver's current directory when first asked (loading the config asks).

    Remembered, because in a `ray job submit` driver `ray.init` unpacks the
    job's working directory anew under the same path: the directory the
    process stands in is then deleted (`os.getcwd()` fails) while the path
    holds the same files again.
    """
    return os.path.abspath(os.getcwd())


def working_dir_on_path() -> None:
    """Put the job's working directory first on the import path, as `python -m` does."""
    if working_dir() not in sys.path:
        sys.path.insert(0, working_dir())


def import_builder(path: str) -> Callable[..., tuple[nn.Module, ModelSpec]]:
    """The function `package.module:function` names, imported with the working directory on the path."""
    module_name, _, func_name = path.partition(":")
    working_dir_on_path()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the config's to report, in one line
        raise ConfigError(f"model.builder {path!r}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"model.builder {path!r}: {module_name} has no function {func_name}")
    return func


def build_model(cfg: ModelConfig) -> tuple[nn.Module, ModelSpec]:
    """Call the builder on the meta device; check that it kept the contract."""
    builder = import_builder(cfg.builder)
    try:
        with torch.device("meta"):
            result = builder(**cfg.builder_args())
    except Exception as exc:  # noqa: BLE001 - a builder that fails on its arguments is a config problem
        raise ConfigError(f"model.builder {cfg.builder}: {type(exc).__name__}: {exc} (model.args {json.dumps(cfg.builder_args())})") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module) and isinstance(result[1], ModelSpec)):
        raise ConfigError(f"model.builder {cfg.builder} must return (nn.Module, ModelSpec), got {type(result).__name__}")
    model, spec = result
    real = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    if real:
        raise ConfigError(f"model.builder {cfg.builder} built {real[0]} on {model.get_parameter(real[0]).device}: build on the meta device")
    return model, spec


_vocab: dict[str, int | None] = {}


def model_vocab_size(cfg: ModelConfig) -> int | None:
    """The model's vocabulary (its spec's, else the built-in `model.vocab_size`; None when unknown); cached per model config."""
    key = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    if key not in _vocab:
        _, spec = build_model(cfg)
        _vocab[key] = spec.vocab_size or (cfg.vocab_size if cfg.builder == BUILTIN_BUILDER else None)
    return _vocab[key]


_checked: dict[str, list[str]] = {}


def check_model(cfg: JobConfig) -> None:
    """Build the model on meta and raise ConfigError with the first reason it cannot run at the configured layout.

    The reasons come from `strategies.compose.model_problems`: the generic
    ones (blocks, pipeline stages, TP plan, tied weights, buffers) and the
    model's own (`ModelSpec.check`: heads that tp does not divide, ...).
    Cached per model, layout and sequence length: configs are loaded often.
    """
    key = json.dumps([cfg.model.model_dump(mode="json"), cfg.parallel.model_dump(mode="json"), cfg.data.seq_len], sort_keys=True)
    if key not in _checked:
        model, spec = build_model(cfg.model)
        _checked[key] = model_problems(model, spec, cfg.parallel, cfg.data.seq_len)
    if _checked[key]:
        raise ConfigError(_checked[key][0])


def check_init_from(cfg: JobConfig) -> None:
    """Raise ConfigError unless `model.init_from` holds a tensor of the right shape for every parameter (reads the file headers only)."""
    model, spec = build_model(cfg.model)
    try:
        storage.SafetensorsDir(cfg.model.init_from).match({n: tuple(p.shape) for n, p in model.named_parameters()}, spec.checkpoint_key)
    except (storage.CheckpointError, OSError) as exc:
        raise ConfigError(f"model.init_from: {exc}") from None


def initialize(pm: ParallelModel, model: nn.Module, cfg: JobConfig) -> str:
    """Fill the materialised `pm` with the job's initial weights; returns where they came from.

    From `model.init_from` (each rank reads its slices of the safetensors
    files) or else from the spec's seeded initialiser (`training.seed`);
    `model` is the whole model on meta. Either way every layout starts from
    the same weights.
    """
    if cfg.model.init_from:
        storage.load_pretrained(cfg.model.init_from, pm.model_parts, checkpoint_key=pm.spec.checkpoint_key)
        return cfg.model.init_from
    init_weights(pm, model, cfg.training.seed)
    return f"seed {cfg.training.seed}"


def build_parallel_model(cfg: JobConfig, mesh, device: torch.device) -> ParallelModel:
    """The job's model parallelized over `mesh` and materialised on `device` (parameters not yet filled).

    `initialize` needs the whole model too (on meta, from `build_model`): a
    resumed generation does not, and does not pay for it.
    """
    from strategies import parallelize

    model, spec = build_model(cfg.model)
    pm = parallelize(model, mesh, cfg.parallel, micro_batch=cfg.training.micro_batch, spec=spec)
    pm.materialize(device)
    return pm


def build_optimizer(params, t: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW with the configured hyper-parameters; its state is per parameter element, so it reshards with the parameters."""
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for_loop": {"foreach": False}}[t.optimizer_impl]
    return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay, **impl)
