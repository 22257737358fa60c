"""Seeded initial weights that are the same at every layout, drawn module by module.

Each module that owns parameters is initialised on its own: a full-size CPU
copy of the module (its own parameters only; children stay on meta) is
filled by `ModelSpec.init_weights(module, fqn, generator)`, or by the
module's `reset_parameters()` by default, from a generator seeded by the job's
seed and the module's name alone. So the weights do not depend on the layout,
on which rank draws them or in which order, and a rank draws only the modules
whose parameters it holds (a pipeline stage never draws another stage's).
Peak memory is one module's full parameters.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Iterator

import torch
from torch import nn

from strategies.compose import ParallelModel, fill_from_full
from strategies.spec import ModelSpec


def module_generator(seed: int, fqn: str) -> torch.Generator:
    """The generator that initialises module `fqn` for job seed `seed`."""
    digest = hashlib.sha256(f"{seed}/{fqn}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def reset_from(module: nn.Module, generator: torch.Generator) -> None:
    """The default initialiser: the module's own `reset_parameters()`, drawing from `generator`."""
    if not hasattr(module, "reset_parameters"):
        raise ValueError(f"{type(module).__name__} has no reset_parameters(): give ModelSpec.init_weights to initialise it")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**62, (), generator=generator)))
        module.reset_parameters()


def _own_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` whose own parameters are real CPU tensors; its children are shared, left as they are."""
    clone = copy.deepcopy(module, memo={id(child): child for child in module.children()})
    return clone.to_empty(device="cpu", recurse=False)


def initial_tensors(model: nn.Module, spec: ModelSpec, seed: int, wanted: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full initial tensor) of every parameter of `model` (on meta), or of the modules holding any of `wanted`."""
    for prefix, module in model.named_modules():
        own = [(f"{prefix}.{n}" if prefix else n, p) for n, p in module.named_parameters(recurse=False)]
        if not own or (wanted is not None and not wanted.intersection(n for n, _ in own)):
            continue
        clone = _own_copy(module)
        generator = module_generator(seed, prefix)
        with torch.no_grad():
            (spec.init_weights or _default)(clone, prefix, generator)
        for (name, _), (_, value) in zip(own, clone.named_parameters(recurse=False)):
            yield name, value.detach()


def _default(module: nn.Module, fqn: str, generator: torch.Generator) -> None:
    reset_from(module, generator)


def initial_state(model: nn.Module, spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Every full initial tensor by name: what a single-process reference starts from."""
    return dict(initial_tensors(model, spec, seed))


def init_weights(pm: ParallelModel, model: nn.Module, seed: int) -> None:
    """Fill this rank's parameters of `pm` (materialised) with their initial values; `model` is the whole model on meta."""
    local = dict(pm.named_parameters())
    filled = set()
    for name, full in initial_tensors(model, pm.spec, seed, wanted=set(local)):
        if name in local:
            fill_from_full(local[name], full)
            filled.add(name)
    if missing := sorted(set(local) - filled):
        raise ValueError(f"no initial value for {missing[:3]}: they are not parameters of the full model given")
