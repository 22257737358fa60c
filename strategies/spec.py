"""What `parallelize()` needs to know about a model besides the `nn.Module` itself.

Bring your own model
--------------------
Build the module on the meta device and describe it with a `ModelSpec`::

    spec = ModelSpec(
        blocks="layers",                 # the repeated blocks (nn.ModuleDict or nn.ModuleList), run in order
        first=("embed",),                # top-level parts only the first pipeline stage keeps
        last=("head",),                  # parts only the last stage keeps
        tp_plan={"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()},
        split_points=None,               # or ["layers.2"] / a callable(n_stages) -> block names
    )
    pm = parallelize(model, mesh, parallel_cfg, micro_batch=4, spec=spec)

How a stage runs
----------------
With `run_parts=True` the library runs every stage (and the unsplit model)
itself: the `first` parts it still has, in order, on the input; then
`block_inputs(stage_module, hidden, seq_len)` once, whose dict goes to every
block as keyword arguments (rotary position embeddings, say, computed for
the full `seq_len` even where a stage holds only a sequence shard of the
hidden state under sequence parallelism); then the blocks left, in order
(a block may return a tuple: its first element goes on); then the `last`
parts. That is what a Hugging Face model needs, whose own `forward` cannot
run a pipeline stage. Blocks may then be an `nn.ModuleList`: a pipeline stage
turns it into an `nn.ModuleDict` under the same names.

With `run_parts=False` (the default) the module's own `forward(x)` runs, and
it keeps this contract: the blocks are an `nn.ModuleDict` (a stage deletes the
blocks it does not own, the others keep their full-model names); a part in
`first`/`last` may be None (then `forward` passes its input through) and the
loop goes over the blocks left; one tensor in, one tensor out.

Either way `loss_fn(output, labels)` returns the *summed* loss of the
micro-batch (the caller scales it by `loss_scale`). Blocks are the FSDP
units, the activation-checkpointing units and the pipeline granularity.
`tp_plan` maps module FQN patterns (`*` = one name atom) to DTensor
`ParallelStyle`s; give a callable `tp_plan(sequence_parallel=...)` to honour
the `sequence_parallel` switch. Without `split_points`, stages are balanced by
`block_cost` (default: parameter count), the first stage also paying for
`first` and the last for `last`.

Weights and checks
------------------
- `init_weights(module, fqn, generator)` fills the parameters `module` owns
  directly (a full-size CPU copy of the module at `fqn`) from `generator`,
  which is seeded from the job's seed and `fqn` alone: every layout starts
  from identical weights. Default: the module's own `reset_parameters()`
  drawing from that seed.
- `init_buffers(stage_module)` re-creates the buffers after the model is
  materialised with `to_empty` (rotary `inv_freq`, ...): they are garbage
  then, and checkpoints hold parameters only. A model with buffers must give it.
- `checkpoint_key(fqn, keys)` names the tensor of a pretrained checkpoint
  (whose tensor names are `keys`) that initialises parameter `fqn`.
- `check(parallel, seq_len)` returns what keeps this model from running at a
  parallel layout and sequence length (heads that `tp` does not divide, ...),
  each a one-line message naming the field: the job refuses to start with it.
- `export_files(dtype)` gives the files written next to exported weights of
  that dtype (a Hugging Face `config.json`, ...), by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

TPPlan = dict[str, ParallelStyle]


class ParallelOptions(Protocol):
    """The parallel settings `parallelize()` reads (the job config's `parallel` section has them)."""

    pp: int
    tp: int
    sequence_parallel: bool
    pp_schedule: str
    pp_microbatches: int
    pp_virtual_stages: int
    reshard_after_forward: bool
    activation_checkpointing: bool


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over every position (callers divide by the global token count)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


@dataclass
class ModelSpec:
    blocks: str = "layers"
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    tp_plan: TPPlan | Callable[..., TPPlan] | None = None
    split_points: Sequence[str] | Callable[[int], Sequence[str]] | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum
    block_cost: Callable[[nn.Module], float] | None = None  # default: parameter count
    run_parts: bool = False
    block_inputs: Callable[[nn.Module, torch.Tensor, int], dict] | None = None
    init_weights: Callable[[nn.Module, str, torch.Generator], None] | None = None
    init_buffers: Callable[[nn.Module], None] | None = None
    checkpoint_key: Callable[[str, frozenset], str] | None = None
    check: Callable[[ParallelOptions, int], list[str]] | None = None
    export_files: Callable[[torch.dtype], dict[str, bytes]] | None = None
    vocab_size: int | None = None  # token ids the model takes (synthetic data draws from them)

    def plan(self, *, sequence_parallel: bool) -> TPPlan | None:
        """The TP plan to apply (None: the model cannot be tensor-parallel)."""
        if callable(self.tp_plan):
            return self.tp_plan(sequence_parallel=sequence_parallel)
        return self.tp_plan

    def problems(self, parallel: ParallelOptions, seq_len: int) -> list[str]:
        """The model's own objections to this layout and sequence length (`check`), none without one."""
        return list(self.check(parallel, seq_len)) if self.check is not None else []
