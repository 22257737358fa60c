"""The layout planner: memory, communication and pipeline bubble of every layout.

Pure Python arithmetic (no torch), used by `elastic plan` and by the controller
on every resize (`choose_layout`, through `elastic.planning`, which turns a job
config into its inputs). What a model itself allows (heads that tp must
divide, ...) comes in as a `ModelCheck`: the model's `ModelSpec`, not a copy here. All sizes are bytes, all times seconds,
GB means 1e9 bytes. The estimates are first-order models meant to rank layouts
and to say which ones fit, not to predict a step time to the percent.

Memory accounting (the ZeRO paper's, mixed-precision Adam): each parameter
costs 16 bytes of model state: 2 (bf16 weight) + 2 (bf16 gradient) +
12 (fp32 master weight, Adam first and second moments). Tensor and pipeline
parallelism divide the parameters before any data-parallel sharding does.

Rank layout: ranks are ordered `(pp, dp_replicate, dp_shard, tp)` with `tp`
fastest (see `elastic.layout`), so the ranks of an axis group are spaced by
the product of the inner degrees. That spacing decides which groups stay on
one node and which cross the slower inter-node link.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from strategies.layout import Layout, LayoutError

ModelCheck = Callable[[Layout], "str | None"]
"""Why the model cannot run at a layout (one line), or None: the model's own constraints (`ModelSpec.check`)."""

BYTES_PER_PARAM = 16
"""Model state per parameter: bf16 weight (2) + bf16 gradient (2) + fp32 master, m and v (12)."""
WEIGHT_BYTES = 2
"""bf16: the precision parameters are gathered and activations stored in."""
GRAD_REDUCE_BYTES = 4
"""The runtime's mixed-precision policy reduces gradients in fp32, so a gradient collective moves 4 bytes a parameter."""
OPTIMIZER_BYTES = BYTES_PER_PARAM - 2 * WEIGHT_BYTES
"""fp32 master weight + Adam m + Adam v = 12 bytes a parameter."""
HEAD_DIM = 128
"""Head size assumed when only a parameter count is known (most current LLMs use 128)."""
STRATEGIES = ("dp", "zero1", "zero2", "zero3", "hsdp")
RUNNABLE = frozenset({"zero2", "zero3", "hsdp"})
"""The strategies of STRATEGIES the runtime runs (FSDP2: zero3 and hsdp, zero2 with parallel.reshard_after_forward
false); the model state under plain DP and ZeRO-1 is shown for comparison only."""


# --------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Hardware:
    """The cluster: how many GPUs, how they are grouped into nodes, their memory, links and speed.

    Bandwidths are bytes per second a GPU can send over that link class
    (NVLink-class inside a node, network between nodes). Compute is the
    dense bf16 peak of one GPU (`peak_flops`) times the share of it a step
    sustains (`mfu`, model FLOPs utilisation): a step never runs at the
    peak, and the compute estimate (which weighs the pipeline bubble against
    communication time) would otherwise be too short by 1 / mfu (2.5x at
    the default).
    """

    gpus: int
    gpus_per_node: int = 8
    gpu_mem_bytes: float = 80e9
    intra_bw: float = 900e9
    inter_bw: float = 50e9
    peak_flops: float = 312e12
    """An A100's dense bf16 peak."""
    mfu: float = 0.4
    """What well-tuned large training runs sustain of the peak (`elastic plan --mfu` sets it)."""

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "gpu_mem_bytes", "intra_bw", "inter_bw", "peak_flops"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware {name} must be > 0, got {getattr(self, name)}")
        if not (math.isfinite(self.mfu) and 0 < self.mfu <= 1):
            raise ValueError(f"hardware mfu {self.mfu} must be a share of the peak in (0, 1]")

    @property
    def flops(self) -> float:
        """The dense throughput one GPU sustains in a step: `peak_flops` x `mfu`."""
        return self.peak_flops * self.mfu


@dataclass(frozen=True)
class ModelProfile:
    """What the planner needs to know about a model: blocks, widths, parameter counts.

    `layer_params` is one block (the mean); `embed_params` sits on the first
    pipeline stage and `head_params` (final norm and output projection) on
    the last. `vocab_size` (None when unknown) sizes the logits; `seq_len`
    and `micro_batch` size activations.
    """

    n_layers: int
    dim: int
    ffn_dim: int
    layer_params: float
    embed_params: float = 0.0
    head_params: float = 0.0
    vocab_size: int | None = None
    seq_len: int = 2048
    micro_batch: int = 1

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise ValueError(f"the model must have parameters, got {self.params:g}")
        if min(self.n_layers, self.dim, self.ffn_dim, self.seq_len, self.micro_batch) < 1:
            raise ValueError("layers, dim, ffn_dim, seq_len and micro_batch must all be >= 1")

    @property
    def params(self) -> float:
        return self.n_layers * self.layer_params + self.embed_params + self.head_params

    @classmethod
    def from_model(cls, model, spec, *, seq_len: int, micro_batch: int) -> "ModelProfile":
        """Exact parameter counts of a model (on meta is enough) from its `ModelSpec`'s parts.

        The blocks are `spec.blocks`, the embedding side `spec.first`, the head
        side `spec.last`. The widths that size activations are read from the
        first block: `dim` is the input width of its first linear layer, `ffn_dim`
        the widest output of its linear layers (the MLP's hidden size).
        """
        def count(module) -> float:
            return float(sum(p.numel() for p in module.parameters())) if module is not None else 0.0

        def part(fqn: str):
            parent, _, leaf = fqn.rpartition(".")
            return getattr(model.get_submodule(parent) if parent else model, leaf, None)

        blocks = list(model.get_submodule(spec.blocks).children())
        linears = [m for m in blocks[0].modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
        if not linears:
            raise ValueError(f"the first block of {spec.blocks} has no linear layer to read the model's width from")
        return cls(
            n_layers=len(blocks), dim=linears[0].in_features, ffn_dim=max(m.out_features for m in linears),
            layer_params=sum(count(b) for b in blocks) / len(blocks),
            embed_params=sum(count(part(f)) for f in spec.first), head_params=sum(count(part(f)) for f in spec.last),
            vocab_size=spec.vocab_size, seq_len=seq_len, micro_batch=micro_batch,
        )

    @classmethod
    def from_params(cls, params: float, *, seq_len: int = 2048, micro_batch: int = 1) -> "ModelProfile":
        """A plausible shape for a bare parameter count, for activation and TP traffic estimates.

        A block of a SwiGLU transformer with ffn = 8/3 dim holds about 12 dim^2
        parameters, and current models keep dim ~ 128 x layers (LLaMA-7B:
        4096 = 128 x 32). Solving 12 * L * (128 L)^2 = params gives L; the
        width is then rounded to a multiple of 8 heads of `HEAD_DIM` (as real
        models have: 32 heads at 7B, 64 at 70B) and the layers recounted
        from it, so that tp of 1 to 8 divides the heads the caller checks
        against (dim / HEAD_DIM). All parameters are counted in the blocks,
        so the state memory is exact and only the activation/traffic figures
        depend on the guessed shape. ffn is rounded up to a multiple of 256 as
        LLaMA does; the vocabulary stays unknown.
        """
        if params <= 0:
            raise ValueError(f"parameter count must be > 0, got {params:g}")
        guess = max(1, round((params / (12 * HEAD_DIM**2)) ** (1 / 3)))
        dim = 8 * HEAD_DIM * max(1, round(guess / 8))
        layers = max(1, round(params / (12 * dim**2)))
        return cls(n_layers=layers, dim=dim, ffn_dim=-(-8 * dim // (3 * 256)) * 256, layer_params=params / layers,
                   seq_len=seq_len, micro_batch=micro_batch)

    def stage_params(self, pp: int) -> float:
        """Parameters on the heaviest pipeline stage.

        Blocks are split as evenly as possible (ceil(L/p) on the fullest stage),
        and the stage also carries the larger of the embedding (first stage)
        and the head (last stage); with one stage it holds everything.
        """
        if pp == 1:
            return self.params
        return math.ceil(self.n_layers / pp) * self.layer_params + max(self.embed_params, self.head_params)


@dataclass(frozen=True)
class StepOptions:
    """How a training step runs: fixed global batch, schedule, recomputation, FSDP resharding.

    `global_batch` None means one micro-batch per GPU at full data
    parallelism (gpus x micro_batch samples). Pipeline micro-batches are the
    gradient-accumulation micro-batches: `global_batch / (dp * micro_batch)`.
    """

    global_batch: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 2
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True


# --------------------------------------------------------------------------- memory
def model_state_bytes(params: float, strategy: str, shard: int = 1) -> float:
    """Per-GPU model state of `params` parameters under a data-parallel strategy over `shard` ranks.

    - dp: every rank keeps everything, 16 P.
    - zero1: optimizer state (12 P) sharded, weights and gradients whole: 4 P + 12 P / N.
    - zero2: gradients sharded too: 2 P + 14 P / N.
    - zero3: weights as well, nothing replicated: 16 P / N.
    - hsdp: ZeRO-3 inside a shard group, replicated across groups; `shard`
      is then the shard group size only (replicas do not divide memory).
    """
    if shard < 1:
        raise ValueError(f"shard group size must be >= 1, got {shard}")
    opt, w = OPTIMIZER_BYTES * params, WEIGHT_BYTES * params
    formulas = {
        "dp": BYTES_PER_PARAM * params,
        "zero1": 2 * w + opt / shard,
        "zero2": w + (w + opt) / shard,
        "zero3": BYTES_PER_PARAM * params / shard,
        "hsdp": BYTES_PER_PARAM * params / shard,
    }
    if strategy not in formulas:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    return formulas[strategy]


def layer_activation_bytes(model: ModelProfile, tp: int) -> float:
    """Activations one block saves for backward for one micro-batch, bf16, per GPU.

    Counted from the built-in block (s = seq, b = micro-batch, h = dim, f = ffn):
    two norm inputs 4sbh; attention input 2sbh, q, k, v 6sbh and its output
    2sbh (fused attention keeps no s x s score matrix); SwiGLU input 2sbh and
    w1 out, w3 out, their gated product 6sbf. Total 16sbh + 6sbf, the analogue
    of Korthikanti et al.'s 34sbh for GeLU with dropout. Tensor parallelism
    with sequence parallelism divides all of it by tp.
    """
    s, b, h, f = model.seq_len, model.micro_batch, model.dim, model.ffn_dim
    return s * b * (16 * h + 6 * f) / tp


def logits_bytes(model: ModelProfile, tp: int) -> float:
    """The output head's logits for one micro-batch: bf16 plus the fp32 copy the loss reads (6 s b V / tp)."""
    return 6 * model.seq_len * model.micro_batch * (model.vocab_size or 0) / tp


def inflight_microbatches(schedule: str, pp: int, microbatches: int, virtual: int = 2) -> float:
    """Micro-batches whose activations the first stage holds at its peak.

    Without a pipeline, gradient accumulation finishes each micro-batch's
    backward before the next forward: 1. GPipe runs every forward first: m.
    1F1B caps the first stage at p. Interleaved 1F1B adds the longer warm-up:
    p (1 + (p-1)/(p v)) (Narayanan et al., 2021).
    """
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "interleaved_1f1b":
        return min(pp * (1 + (pp - 1) / (pp * virtual)), microbatches)
    return min(pp, microbatches)


def activation_bytes(model: ModelProfile, layout: Layout, microbatches: int, schedule: str, virtual: int, checkpointing: bool) -> float:
    """Peak activation memory per GPU (an upper bound: first-stage depth plus last-stage logits).

    Without checkpointing every in-flight micro-batch keeps all blocks of the
    stage. With per-block checkpointing it keeps only each block's input
    (2sbh / tp) and recomputes one block at a time in backward, which then
    needs that one block's full activations. The logits are held once (m
    times under GPipe, whose backwards start after all forwards).
    """
    layers = math.ceil(model.n_layers / layout.pp)
    inflight = inflight_microbatches(schedule, layout.pp, microbatches, virtual)
    full_layer = layer_activation_bytes(model, layout.tp)
    if checkpointing:
        block_input = WEIGHT_BYTES * model.seq_len * model.micro_batch * model.dim / layout.tp
        blocks = inflight * layers * block_input + full_layer
    else:
        blocks = inflight * layers * full_layer
    logit_copies = microbatches if schedule == "gpipe" and layout.pp > 1 else 1
    return blocks + logit_copies * logits_bytes(model, layout.tp)


def gathered_block_bytes(model: ModelProfile, layout: Layout) -> float:
    """FSDP's transient working set: two blocks' bf16 weights gathered (the current one and the prefetched next)."""
    return 2 * WEIGHT_BYTES * model.layer_params / layout.tp if layout.dp_shard > 1 else 0.0


# --------------------------------------------------------------------------- communication
def all_reduce_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `size` bytes: a reduce-scatter plus an all-gather, 2 S (n-1)/n."""
    return 2 * size * (n - 1) / n


def all_gather_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-gather (or reduce-scatter) whose full result is `size`: S (n-1)/n."""
    return size * (n - 1) / n


def group_is_intra_node(layout: Layout, axis: str, gpus_per_node: int) -> bool:
    """Whether every group along `axis` (and all axes inside it) sits on one node.

    A group spans `size x stride` consecutive ranks, stride being the product
    of the inner degrees. It stays inside a node when the whole world does, or
    when that span tiles a node exactly; otherwise some group crosses nodes
    and, as a ring runs at its slowest link, we charge it all to the network.
    """
    axes = ("pp", "dp_replicate", "dp_shard", "tp")
    span = math.prod(getattr(layout, a) for a in axes[axes.index(axis):])
    return layout.world_size <= gpus_per_node or gpus_per_node % span == 0


@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU sends per optimizer step for one kind of communication, and on which link class."""

    kind: str
    link: str
    bytes: float


def tp_traffic(model: ModelProfile, layout: Layout, microbatches: int, checkpointing: bool) -> float:
    """Tensor-parallel activation collectives per GPU and step.

    Each block all-reduces its activations twice in forward (after attention
    and after the MLP) and twice in backward; recomputation under
    checkpointing repeats the two forward ones. Sequence parallelism swaps
    each all-reduce for a reduce-scatter plus an all-gather of the same volume.
    """
    if layout.tp == 1:
        return 0.0
    per_block = 6 if checkpointing else 4
    size = WEIGHT_BYTES * model.seq_len * model.micro_batch * model.dim
    blocks = math.ceil(model.n_layers / layout.pp)
    return microbatches * blocks * per_block * all_reduce_bytes(size, layout.tp)


def fsdp_traffic(model: ModelProfile, layout: Layout, microbatches: int, reshard_after_forward: bool) -> float:
    """FSDP inside the shard group per GPU and step.

    Parameters (bf16) are all-gathered before each micro-batch's forward and,
    when they were freed after forward (ZeRO-3), again before its backward.
    Gradients accumulate unsharded across micro-batches and are
    reduce-scattered (fp32) once per step.
    """
    n = layout.dp_shard
    if n == 1:
        return 0.0
    params = model.stage_params(layout.pp) / layout.tp
    gathers = microbatches * (2 if reshard_after_forward else 1)
    return gathers * all_gather_bytes(WEIGHT_BYTES * params, n) + all_gather_bytes(GRAD_REDUCE_BYTES * params, n)


def replica_traffic(model: ModelProfile, layout: Layout) -> float:
    """HSDP across replicas per GPU and step: each rank all-reduces its gradient shard (fp32) with its replicas."""
    r = layout.dp_replicate
    if r == 1:
        return 0.0
    shard = GRAD_REDUCE_BYTES * model.stage_params(layout.pp) / layout.tp / layout.dp_shard
    return all_reduce_bytes(shard, r)


def pp_traffic(model: ModelProfile, layout: Layout, microbatches: int, chunks: int) -> float:
    """Pipeline point-to-point per GPU and step (a middle stage).

    Per micro-batch and model chunk, a stage sends its output activation
    forward and an activation gradient back, each 2sbh bytes, split along the
    sequence across the tp ranks under sequence parallelism.
    """
    if layout.pp == 1:
        return 0.0
    boundary = WEIGHT_BYTES * model.seq_len * model.micro_batch * model.dim / layout.tp
    return 2 * microbatches * chunks * boundary


def traffic(model: ModelProfile, layout: Layout, gpus_per_node: int, microbatches: int, options: StepOptions) -> list[Traffic]:
    """Every non-zero communication of a step, each tagged with the link class its group uses."""
    chunks = options.virtual_stages if options.schedule == "interleaved_1f1b" else 1
    volumes = (
        ("tp", "tp", tp_traffic(model, layout, microbatches, options.activation_checkpointing)),
        ("fsdp", "dp_shard", fsdp_traffic(model, layout, microbatches, options.reshard_after_forward)),
        ("hsdp_replicas", "dp_replicate", replica_traffic(model, layout)),
        ("pp", "pp", pp_traffic(model, layout, microbatches, chunks)),
    )
    return [
        Traffic(kind, "intra" if group_is_intra_node(layout, axis, gpus_per_node) else "inter", volume)
        for kind, axis, volume in volumes
        if volume > 0
    ]


# --------------------------------------------------------------------------- pipeline and time
def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Idle share of a pipelined step: (p-1)/(v m + p-1).

    Filling and draining the pipeline costs p-1 micro-batch slots on each
    stage against m useful ones (GPipe and 1F1B alike). With v interleaved
    chunks per stage each slot is 1/v as long, so the fill and drain shrink
    v-fold relative to the work: v = 1 gives the plain (p-1)/(m+p-1).
    """
    if stages < 1 or microbatches < 1 or virtual < 1:
        raise ValueError("stages, micro-batches and virtual stages must all be >= 1")
    return (stages - 1) / (virtual * microbatches + stages - 1)


def compute_seconds(model: ModelProfile, world: int, flops: float, global_batch: int, checkpointing: bool) -> float:
    """Ideal compute time per step per GPU: 6 flops per parameter and token (2 forward, 4 backward).

    Recomputation adds one more forward (8 instead of 6). Attention's s^2
    term is left out: it does not depend on the layout, so it does not
    change the ranking.
    """
    flops_per_token = (8 if checkpointing else 6) * model.params
    return flops_per_token * global_batch * model.seq_len / (world * flops)


# --------------------------------------------------------------------------- one layout
@dataclass(frozen=True)
class PlanEntry:
    """The planner's estimate for one layout; bytes are per GPU, traffic per GPU and step."""

    layout: Layout
    microbatches: int
    gpu_params: float
    model_state: dict[str, float]
    state_bytes: float
    activation_bytes: float
    activation_bytes_ckpt: float
    working_bytes: float
    total_bytes: float
    traffic: list[Traffic]
    bubble: float
    bubble_interleaved: float
    compute_s: float
    comm_s: float
    step_s: float
    fits: bool

    @property
    def intra_bytes(self) -> float:
        return sum((t.bytes for t in self.traffic if t.link == "intra"), 0.0)

    @property
    def inter_bytes(self) -> float:
        return sum((t.bytes for t in self.traffic if t.link == "inter"), 0.0)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(layout=self.layout.as_dict(), intra_bytes=self.intra_bytes, inter_bytes=self.inter_bytes)
        return out


def runtime_state_bytes(gpu_params: float, layout: Layout, reshard_after_forward: bool) -> float:
    """What the runtime's FSDP actually holds: ZeRO-3 inside the shard group, or ZeRO-2 when
    parameters stay gathered between forward and backward (`reshard_after_forward=False`)."""
    return model_state_bytes(gpu_params, "hsdp" if reshard_after_forward else "zero2", layout.dp_shard)


def evaluate(layout: Layout, model: ModelProfile, hardware: Hardware, options: StepOptions = StepOptions()) -> PlanEntry:
    """Estimate memory, traffic, bubble and step time of one layout (on `layout.world_size` GPUs).

    Step time = compute / (1 - bubble) + communication time, with no overlap
    of communication and compute: pessimistic, but the same for every layout.
    """
    global_batch = options.global_batch or layout.world_size * model.micro_batch
    microbatches = layout.grad_accum_steps(global_batch, model.micro_batch)
    gpu_params = model.stage_params(layout.pp) / layout.tp
    states = {s: model_state_bytes(gpu_params, s, layout.dp_shard if s == "hsdp" else layout.dp) for s in STRATEGIES}
    act = {ac: activation_bytes(model, layout, microbatches, options.schedule, options.virtual_stages, ac) for ac in (False, True)}
    state = runtime_state_bytes(gpu_params, layout, options.reshard_after_forward)
    working = gathered_block_bytes(model, layout)
    total = state + act[options.activation_checkpointing] + working
    flows = traffic(model, layout, hardware.gpus_per_node, microbatches, options)
    bw = {"intra": hardware.intra_bw, "inter": hardware.inter_bw}
    comm_s = sum(t.bytes / bw[t.link] for t in flows)
    bubble = bubble_fraction(layout.pp, microbatches)
    bubble_v = bubble_fraction(layout.pp, microbatches, options.virtual_stages)
    used_bubble = bubble_v if options.schedule == "interleaved_1f1b" else bubble
    compute_s = compute_seconds(model, layout.world_size, hardware.flops, global_batch, options.activation_checkpointing)
    return PlanEntry(
        layout=layout, microbatches=microbatches, gpu_params=gpu_params, model_state=states, state_bytes=state,
        activation_bytes=act[False], activation_bytes_ckpt=act[True], working_bytes=working, total_bytes=total,
        traffic=flows, bubble=bubble, bubble_interleaved=bubble_v, compute_s=compute_s, comm_s=comm_s,
        step_s=compute_s / (1 - used_bubble) + comm_s, fits=total <= hardware.gpu_mem_bytes,
    )


# --------------------------------------------------------------------------- all layouts
def divisors(n: int) -> list[int]:
    """Every degree an axis of an n-rank world can take, ascending (found up to sqrt(n): resizes scan many worlds)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def layout_problem(
    layout: Layout, model: ModelProfile, gpus_per_node: int, global_batch: int, options: StepOptions, check: ModelCheck | None = None
) -> str | None:
    """Why a layout cannot run this model and batch, or None when it can.

    tp must stay inside a node; the model must allow the layout (`check`:
    heads that tp divides, ...); each pipeline stage (each chunk, when
    interleaved) needs at least one block; the data-parallel degree must split
    the fixed global batch (how many micro-batches that makes per rank is
    free: accumulation adapts).
    """
    if gpus_per_node % layout.tp:
        return f"tp={layout.tp} does not divide the {gpus_per_node} GPUs of a node"
    if check is not None and (problem := check(layout)):
        return f"{layout}: {problem}"
    chunks = options.virtual_stages if options.schedule == "interleaved_1f1b" and layout.pp > 1 else 1
    if layout.pp * chunks > model.n_layers:
        return f"pp={layout.pp}" + (f" x {chunks} chunks" if chunks > 1 else "") + f" exceeds the {model.n_layers} layers"
    if global_batch % layout.dp:
        return f"data-parallel degree {layout.dp} does not divide the global batch {global_batch}"
    return None


def candidate_layouts(world: int) -> Iterable[Layout]:
    """Every `(pp, dp_replicate, dp_shard, tp)` whose product is `world`."""
    for pp in divisors(world):
        for tp in divisors(world // pp):
            rest = world // (pp * tp)
            for r in divisors(rest):
                yield Layout(pp=pp, dp_replicate=r, dp_shard=rest // r, tp=tp)


def rank_key(entry: PlanEntry) -> tuple:
    """Layouts that fit first, then the fastest estimated step; ties go to less model parallelism."""
    return (not entry.fits, round(entry.step_s, 9), entry.layout.tp, entry.layout.pp, entry.layout.dp_replicate)


def plan(model: ModelProfile, hardware: Hardware, options: StepOptions = StepOptions(), check: ModelCheck | None = None) -> list[PlanEntry]:
    """Every valid layout for `hardware.gpus` GPUs (that the model allows, given its `check`), evaluated and ranked (see `rank_key`)."""
    global_batch = options.global_batch or hardware.gpus * model.micro_batch
    entries = [
        evaluate(layout, model, hardware, options)
        for layout in candidate_layouts(hardware.gpus)
        if layout_problem(layout, model, hardware.gpus_per_node, global_batch, options, check) is None
    ]
    return sorted(entries, key=rank_key)


# --------------------------------------------------------------------------- resize
def _kept_candidates(world: int, bases: list[Layout]) -> list[tuple[Layout, str]]:
    """Layouts of `world` ranks keeping a base's tp and pp: its dp_replicate first, then folded into dp_shard."""
    out: dict[Layout, str] = {}
    for base in bases:
        model_parallel = base.tp * base.pp
        if world % model_parallel:
            continue
        dp = world // model_parallel
        if base.dp_replicate > 1 and dp % base.dp_replicate == 0:
            out.setdefault(Layout(pp=base.pp, dp_replicate=base.dp_replicate, dp_shard=dp // base.dp_replicate, tp=base.tp), "kept")
        out.setdefault(Layout(pp=base.pp, dp_replicate=1, dp_shard=dp, tp=base.tp), "folded" if base.dp_replicate > 1 else "kept")
    return list(out.items())


def _problem(
    layout: Layout, model: ModelProfile, hardware: Hardware | None, node: int | None, options: StepOptions, check: ModelCheck | None
) -> str | None:
    """Why `layout` cannot run the job (shape, batch, or memory when the hardware is known), or None.

    `node` None means a single node holds every worker, so any tp is node-local.
    """
    problem = layout_problem(layout, model, node or layout.world_size, options.global_batch, options, check)
    if problem or hardware is None:
        return problem
    entry = evaluate(layout, model, hardware, options)
    if not entry.fits:
        return f"{layout} needs {entry.total_bytes / 1e9:.1f} GB per GPU, more than {hardware.gpu_mem_bytes / 1e9:.1f} GB"
    return None


def choose_layout(
    world: int,
    model: ModelProfile,
    options: StepOptions,
    *,
    configured: Layout,
    min_workers: int,
    workers_per_node: int | None = None,
    previous: Layout | None = None,
    hardware: Hardware | None = None,
    check: ModelCheck | None = None,
) -> tuple[Layout, str]:
    """The layout for `world` available workers, and a one-line reason for the event log.

    `configured` holds the job's tp, pp and dp_replicate (its dp_shard is
    re-derived from the world). Preference, from the largest world <= `world`
    down to `min_workers`: keep tp (its group lives on one node) and pp
    (chosen for memory) of the configured layout, else of the previous one,
    and change only the
    data-parallel degrees: keep dp_replicate when it divides, else fold it
    into dp_shard. The data-parallel degree must divide the global batch,
    which never changes (gradient accumulation absorbs the difference). Only
    when no world keeps tp and pp does any other valid layout qualify (ranked
    by the planner when the hardware is known). Without hardware (CPU runs)
    memory never rules a layout out; `workers_per_node` (None: one node
    holds them all) keeps tp inside a node, and `check` is what the model
    allows. Raises LayoutError naming why when nothing qualifies. When the
    layout leaves workers idle, the reason says how many and why all `world`
    of them could not be used.
    """
    if world < 1:
        raise LayoutError(f"no workers available (world {world})")
    node = hardware.gpus_per_node if hardware else workers_per_node
    bases = list(dict.fromkeys([configured] + ([previous] if previous else [])))
    floor = min(min_workers, world)
    problems: list[str] = []
    multiples = " or ".join(str(b.tp * b.pp) for b in bases)
    whole = None  # why not all `world` workers: said when some are left idle
    for w in range(world, floor - 1, -1):
        candidates = _kept_candidates(w, bases)
        if not candidates and whole is None:
            whole = f"{world} is no multiple of tp*pp ({multiples})"
        for layout, how in candidates:
            problem = _problem(layout, model, hardware, node, options, check)
            if problem is None:
                return layout, _reason(world, layout, how, options.global_batch, model.micro_batch, previous, whole)
            problems.append(f"{problem} at {w} workers")
            whole = whole or problems[0]
    more = f" (and {len(problems) - 1} smaller candidates failed)" if len(problems) > 1 else ""
    kept = (problems[0] + more) if problems else f"no worker count in {floor}..{world} is a multiple of tp*pp ({multiples})"
    for w in range(min(world, _world_bound(model, node, options)), floor - 1, -1):
        found = _best_other(w, model, hardware, node, options, check)
        if found is not None:
            idle = f"no valid layout of {world} workers" if found.world_size < world else None
            return found, _reason(world, found, "replanned", options.global_batch, model.micro_batch, previous, idle) + f"; tp/pp not kept: {kept}"
    raise LayoutError(
        f"no layout for {floor}..{world} workers (min_workers {min_workers}): tp/pp not kept: {kept}; "
        "no other layout is valid" + (" within the GPU memory" if hardware else "")
    )


def _world_bound(model: ModelProfile, node: int | None, options: StepOptions) -> float:
    """No valid layout has more ranks than this: dp divides the global batch, tp stays inside a node, pp x chunks <= layers.
    It spares a large world the search of every smaller one (unbounded when the node size is unknown)."""
    chunks = options.virtual_stages if options.schedule == "interleaved_1f1b" else 1
    return options.global_batch * max(1, model.n_layers // chunks) * node if node else math.inf


def _best_other(
    world: int, model: ModelProfile, hardware: Hardware | None, node: int | None, options: StepOptions, check: ModelCheck | None
) -> Layout | None:
    """Any valid layout of exactly `world` ranks: the planner's best that fits, or the least model parallelism without hardware."""
    valid = [l for l in candidate_layouts(world) if _problem(l, model, hardware, node, options, check) is None]
    if not valid:
        return None
    if hardware is None:
        return min(valid, key=lambda l: (l.tp * l.pp, l.pp, l.dp_replicate))
    return min((evaluate(l, model, hardware, options) for l in valid), key=rank_key).layout


def _reason(world: int, layout: Layout, how: str, global_batch: int, micro_batch: int, previous: Layout | None, idle_why: str | None) -> str:
    """One line for the event log: what changed, what was kept, how the batch is split, who is left idle and why."""
    was = f"{previous} -> " if previous and previous != layout else ""
    kept = {"kept": f"kept tp={layout.tp} pp={layout.pp}", "folded": f"kept tp={layout.tp} pp={layout.pp}, folded dp_replicate into dp_shard",
            "replanned": f"replanned to tp={layout.tp} pp={layout.pp}"}[how]
    accum = layout.grad_accum_steps(global_batch, micro_batch)
    local = layout.local_batch(global_batch)
    split = (f"{accum} micro-batches of {micro_batch}" if local % micro_batch == 0
             else f"{local} sample{'s' if local > 1 else ''} ({accum} micro-batch{'es' if accum > 1 else ''} of at most {micro_batch})")
    idle = world - layout.world_size
    spare = f"; {idle} of {world} workers idle ({idle_why})" if idle else ""
    return f"layout {was}{layout} on {layout.world_size} workers ({kept}); global batch {global_batch} = dp {layout.dp} x {split}{spare}"
