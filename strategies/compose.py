"""Compose the strategies over the layout's mesh, and run one step's forward/backward."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, distribute_tensor

from strategies.ac import apply_ac
from strategies.fsdp import apply_fsdp
from strategies.pipeline import build_schedule, default_microbatches, split_model
from strategies.spec import ModelSpec, ParallelOptions
from strategies.stage import blocks_as_dict, install_stage_forward
from strategies.tp import apply_tp, unmatched_plan_keys


@dataclass
class ParallelModel:
    """The local part(s) of a parallelized model and how to run a step on them.

    Without pipeline parallelism `model_parts` is the one local model. With it,
    `model_parts` are this rank's stage modules (one, or `pp_virtual_stages`
    for interleaved 1F1B), `stage_ids` their stage indices, and `schedule` runs
    the step; parameter names are the full model's on every layout.
    """

    model_parts: list[nn.Module]
    mesh: DeviceMesh
    micro_batch: int
    spec: ModelSpec
    extra: dict = field(default_factory=dict)
    schedule: Any = None
    stages: list = field(default_factory=list)
    stage_ids: list[int] = field(default_factory=lambda: [0])
    n_stages: int = 1
    n_microbatches: int = 0
    seq_divisor: int = 1  # sequence parallelism shards the sequence dim over tp: seq_len must divide
    _loss_scale: float = 1.0

    @property
    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return self.spec.loss_fn

    def materialize(self, device: torch.device | str) -> None:
        """Give the local parts real (uninitialised) storage on `device`, then re-create their buffers (`ModelSpec.init_buffers`).

        Parameters are filled afterwards: `strategies.init_weights`, a pretrained
        checkpoint or a training checkpoint.
        """
        for part in self.model_parts:
            part.to_empty(device=device)
            if self.spec.init_buffers is not None:
                with torch.no_grad():
                    self.spec.init_buffers(part)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def parameters(self):
        for part in self.model_parts:
            yield from part.parameters()

    def named_parameters(self):
        for part in self.model_parts:
            yield from part.named_parameters()

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, loss_scale: float) -> torch.Tensor:
        """Forward and backward over the local batch; gradients accumulate in the parameters.

        Each micro-batch's summed loss is multiplied by `loss_scale` before
        backward. Returns the unscaled summed loss of the local batch
        (detached); under pipeline parallelism only the last stage has it and
        the other ranks return zero. Without PP the batch is cut into
        `micro_batch`-sized pieces (gradient accumulation); with PP the
        schedule's `n_microbatches` replace that.
        """
        if inputs.shape[1] % self.seq_divisor:
            raise ValueError(
                f"sequence parallelism shards the sequence over tp={self.seq_divisor}: "
                f"seq_len {inputs.shape[1]} must divide by it (or set parallel.sequence_parallel=false)"
            )
        if self.schedule is not None:
            return self._pipeline_step(inputs, labels, loss_scale)
        (model,) = self.model_parts
        chunks = list(zip(inputs.split(self.micro_batch), labels.split(self.micro_batch)))
        total = torch.zeros((), device=inputs.device)
        for i, (x, y) in enumerate(chunks):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(i == len(chunks) - 1)
            loss = self.loss_fn(model(x), y)
            (loss * loss_scale).backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward only over the local batch: its summed loss (zero on ranks without the last pipeline stage).

        The same micro-batching as `forward_backward`, no gradients: held-out
        evaluation between steps leaves the parameters and their gradients as they were.
        FSDP keeps the root's parameters gathered after forward for the backward
        that follows; with no backward coming, they are resharded here, or the
        module would go on holding full tensors instead of its sharded parameters.
        """
        try:
            return self._evaluate(inputs, labels)
        finally:
            for part in self.model_parts:
                for module in part.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()

    def _evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if inputs.shape[1] % self.seq_divisor:
            raise ValueError(f"sequence parallelism shards the sequence over tp={self.seq_divisor}: seq_len {inputs.shape[1]} must divide by it")
        if self.schedule is not None:
            if inputs.shape[0] % self.n_microbatches:
                raise ValueError(f"the local batch ({inputs.shape[0]}) must divide into parallel.pp_microbatches ({self.n_microbatches})")
            self._loss_scale = 1.0
            losses: list[torch.Tensor] = []
            self.schedule.eval(*((inputs,) if self.has_first_stage else ()), target=labels, losses=losses)
            if not self.has_last_stage:
                return torch.zeros((), device=inputs.device)
            return torch.stack(losses).sum().reshape(())
        (model,) = self.model_parts
        total = torch.zeros((), device=inputs.device)
        for x, y in zip(inputs.split(self.micro_batch), labels.split(self.micro_batch)):
            total += self.loss_fn(model(x), y)
        return total

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self._loss_scale

    def _pipeline_step(self, inputs: torch.Tensor, labels: torch.Tensor, loss_scale: float) -> torch.Tensor:
        if inputs.shape[0] % self.n_microbatches:
            raise ValueError(
                f"the local batch ({inputs.shape[0]}) must divide into parallel.pp_microbatches ({self.n_microbatches})"
            )
        self._loss_scale = loss_scale
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first_stage else ()
        self.schedule.step(*args, target=labels, losses=losses, return_outputs=False)
        if not self.has_last_stage:
            return torch.zeros((), device=inputs.device)
        return (torch.stack([loss.detach() for loss in losses]).sum() / loss_scale).reshape(())


def _dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def model_problems(model: nn.Module, spec: ModelSpec, parallel: ParallelOptions, seq_len: int | None = None) -> list[str]:
    """Why `model` (on meta) cannot run at this layout (and sequence length, if given): one line each, none if it can.

    The generic reasons first (the blocks, the pipeline stages, the TP plan,
    shared parameters, buffers nothing re-creates), then the model's own
    (`ModelSpec.check`), then the sequence length under sequence parallelism.
    """
    try:
        blocks = model.get_submodule(spec.blocks)
    except AttributeError:
        return [f"ModelSpec.blocks {spec.blocks!r} is not a submodule of {type(model).__name__}"]
    if not isinstance(blocks, (nn.ModuleDict, nn.ModuleList)):
        return [f"ModelSpec.blocks {spec.blocks!r} is a {type(blocks).__name__}, not an nn.ModuleDict or nn.ModuleList"]
    problems = []
    chunks = parallel.pp_virtual_stages if parallel.pp > 1 and parallel.pp_schedule == "interleaved_1f1b" else 1
    if parallel.pp * chunks > len(blocks):
        stages = f"parallel.pp ({parallel.pp})" + (f" x pp_virtual_stages ({chunks})" if chunks > 1 else "")
        problems.append(f"{stages} pipeline stages exceed the model's {len(blocks)} blocks")
    if parallel.pp > 1 and isinstance(blocks, nn.ModuleList) and not spec.run_parts:
        problems.append(f"{spec.blocks} must be an nn.ModuleDict for pipeline stages the model's own forward runs; or set ModelSpec.run_parts=True")
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    if tied := [n for n in names.values() if len(n) > 1]:
        problems.append(
            f"parameters shared between modules ({' = '.join(tied[0])}) are not supported: untie them "
            "(Hugging Face models: tie_word_embeddings=False)"
        )
    if spec.init_buffers is None and (buffers := [n for n, _ in model.named_buffers()]):
        problems.append(
            f"the model has buffers ({', '.join(buffers[:3])}{', ...' if len(buffers) > 3 else ''}) that materialising "
            "leaves uninitialised and checkpoints do not hold: give ModelSpec.init_buffers"
        )
    if parallel.tp > 1:
        plan = spec.plan(sequence_parallel=parallel.sequence_parallel)
        if not plan:
            problems.append(f"parallel.tp ({parallel.tp}) > 1 needs a tensor-parallel plan (ModelSpec.tp_plan) for this model")
        elif missing := unmatched_plan_keys(model, plan):
            problems.append(f"tensor-parallel plan keys match no module of the model: {missing}")
    if seq_len is not None:
        problems += spec.problems(parallel, seq_len)
        if parallel.tp > 1 and parallel.sequence_parallel and seq_len % parallel.tp:
            problems.append(f"data.seq_len ({seq_len}) must be divisible by parallel.tp ({parallel.tp}) with sequence parallel")
    return problems


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    parallel: ParallelOptions,
    *,
    micro_batch: int,
    spec: ModelSpec,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> ParallelModel:
    """Apply the strategies to `model` (on meta) in the order the package docstring gives.

    `mesh` is the layout's 4-D mesh `("pp", "dp_replicate", "dp_shard", "tp")`;
    `spec` describes the model (`strategies.spec`). `mp_policy` defaults to
    bf16 parameters with fp32 gradient reduction on CUDA and plain fp32
    elsewhere. Call `materialize` on the result, then fill the parameters.
    """
    tp, pp = mesh["tp"].size(), mesh["pp"].size()
    options = {name: getattr(parallel, name) for name in ParallelOptions.__annotations__}
    if problems := model_problems(model, spec, SimpleNamespace(**{**options, "tp": tp, "pp": pp})):
        raise ValueError(problems[0])
    if spec.run_parts:
        blocks_as_dict(model, spec)
    if mp_policy is None:
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mesh.device_type == "cuda"
            else MixedPrecisionPolicy()
        )
    plan = spec.plan(sequence_parallel=parallel.sequence_parallel) if tp > 1 else None

    # 1. pipeline split
    if pp > 1:
        virtual = parallel.pp_virtual_stages if parallel.pp_schedule == "interleaved_1f1b" else 1
        ids, parts = split_model(model, spec, mesh["pp"].get_local_rank(), pp, virtual)
        n_stages = pp * virtual
    else:
        ids, parts, n_stages = [0], [model], 1
    dp_mesh = _dp_mesh(mesh)
    for part in parts:
        # 2. tensor (+ sequence) parallel, 3. activation checkpointing, 4. FSDP / HSDP
        if plan:
            apply_tp(part, mesh["tp"], plan=plan)
        if parallel.activation_checkpointing:
            apply_ac(part, blocks=spec.blocks)
        apply_fsdp(part, dp_mesh, reshard_after_forward=parallel.reshard_after_forward, mp_policy=mp_policy, blocks=spec.blocks)

    seq_shards = tp if plan and parallel.sequence_parallel else 1
    if spec.run_parts:
        for part in parts:
            install_stage_forward(part, spec, seq_shards)
    pm = ParallelModel(model_parts=parts, mesh=mesh, micro_batch=micro_batch, spec=spec, stage_ids=ids, n_stages=n_stages, seq_divisor=seq_shards)
    if pp > 1:
        pm.n_microbatches = parallel.pp_microbatches or default_microbatches(pp, parallel.pp_schedule)
        pm.stages, pm.schedule = build_schedule(
            parts,
            ids,
            n_stages,
            mesh["pp"],
            schedule=parallel.pp_schedule,
            n_microbatches=pm.n_microbatches,
            loss_fn=pm._scaled_loss,
            device=_device(mesh),
        )
    return pm


def fill_from_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's piece of `full` (the whole, unsharded tensor) into `param`: local slicing, no communication."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            src = full.to(device=param.device, dtype=param.dtype)
            local = distribute_tensor(src, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)


def load_full_state(pm: ParallelModel, full: dict[str, torch.Tensor]) -> None:
    """Fill every local parameter from full (unsharded) tensors: each rank slices what it owns, no communication."""
    for name, param in pm.named_parameters():
        fill_from_full(param, full[name])


def _replication(param: torch.Tensor, group_size: int) -> int:
    """How many ranks of one pipeline stage hold this exact piece of `param` (or its gradient)."""
    if not isinstance(param, DTensor):
        return group_size
    mesh = param.device_mesh
    copies = group_size // mesh.size()
    for dim, placement in enumerate(param.placements):
        if placement.is_partial():
            raise ValueError("clip_grad_norm: a gradient is still a partial sum")
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


def clip_grad_norm(pm: ParallelModel, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient L2 norm across every shard and pipeline stage; returns that norm.

    Each rank sums the squares of its local gradient pieces, each divided by
    the number of ranks of its stage that hold the same piece (replicas across
    `dp_replicate`, plain tensors on every tp rank, ...); one all-reduce over
    the whole mesh then gives the sum over distinct pieces of every stage. This
    works whatever mix of meshes and placements the parameters have.
    """
    return clip_grad_norm_and_count(pm, max_norm, False)[0]


def clip_grad_norm_and_count(pm: ParallelModel, max_norm: float, flag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`clip_grad_norm`, and how many ranks passed `flag` True, counted in the same all-reduce (a 0-d tensor).

    Every rank of the mesh joins that all-reduce every step, so each gets the
    same count: a training loop's way to agree on a decision at no collective
    of its own (`elastic.train`: the step a planned resize stops after, which
    each rank hears of at its own moment).
    """
    params = [p for p in pm.parameters() if p.grad is not None]
    stage_ranks = pm.mesh.size() // pm.mesh["pp"].size()
    device = params[0].grad.device if params else _device(pm.mesh)
    sums = torch.tensor([0.0, float(flag)], dtype=torch.float64, device=device)  # [squares, flags]
    total = sums[0]
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        total += g.detach().double().pow(2).sum() / _replication(p.grad, stage_ranks)
    if dist.is_initialized():
        group = None if pm.mesh.size() == dist.get_world_size() else pm.mesh._flatten().get_group()
        dist.all_reduce(sums, group=group)
    norm = total.sqrt().float()
    if max_norm > 0 and params:
        # The same coefficient as torch.nn.utils.clip_grad_norm_, applied to the local pieces
        # (a foreach op over DTensors on different meshes is not allowed).
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm, sums[1]
