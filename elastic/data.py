"""The job's data: its datasets (index -> sample), the global sample order, and the position a checkpoint resumes from.

Every sample is a function of its index alone (synthetic tokens from (seed,
index), corpus windows from the packing rule in `elastic.tokens`, a plug-in
dataset's `[index]`), and the order of samples is a seeded permutation per
epoch. A step consumes the next `global_batch` positions of that order; each
data-parallel rank takes its contiguous slice. So any layout reads the same
samples in the same step.

The position in that order (samples consumed) is what a checkpoint stores and
what a resume continues from, not the step: a job that resumes with another
`training.global_batch` starts its first step at the saved position and goes
on from there. The checkpoint also stores the data's identity (kind, path, a
fingerprint of the files and sizes, seed, seq_len, sample count...); a resume
whose data differs is refused, naming the field, because the position would
then point at other samples.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

import numpy as np
import torch

import storage
from elastic.config import ConfigError, DataConfig, JobConfig
from elastic.tokens import CorpusIndex, TokenReader, TokenWindows, index_corpus, windows_in

SYNTHETIC_SAMPLES = 1 << 20
"""Samples in one epoch of the synthetic data when data.num_samples is unset."""
_STRIDES = np.array([1, 2, 3, 5])


class SyntheticTokens:
    """Arithmetic token sequences: token[j] = (start + stride * j) mod vocab, with rare noise.

    A model must read at least two tokens of context to know the stride, so the
    loss falls from ln(vocab) towards the noise floor as attention learns.
    Indices [first, first + count) of the generator: the eval split takes the
    ones after the training samples.
    """

    def __init__(self, cfg: DataConfig, vocab_size: int, first: int = 0, count: int | None = None):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.first = first
        self.count = count if count is not None else (cfg.num_samples or SYNTHETIC_SAMPLES)

    def __len__(self) -> int:
        return self.count

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.cfg.seed, self.first + index])
        start = rng.integers(self.vocab_size)
        stride = _STRIDES[rng.integers(len(_STRIDES))]
        tokens = (start + stride * np.arange(self.cfg.seq_len + 1)) % self.vocab_size
        noise = rng.random(self.cfg.seq_len + 1) < 0.02
        tokens[noise] = rng.integers(self.vocab_size, size=int(noise.sum()))
        return tokens

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token labels for these sample indices, each (len(indices), seq_len)."""
        rows = np.stack([self.sample(i) for i in indices]) if indices else np.zeros((0, self.cfg.seq_len + 1), dtype=np.int64)
        full = torch.from_numpy(rows.astype(np.int64))
        return full[:, :-1].contiguous(), full[:, 1:].contiguous()


class MapDataset:
    """A plug-in's map-style dataset (`len`, `[index] -> (inputs, labels)`), items [first, first + count) of it."""

    def __init__(self, dataset, seq_len: int, first: int = 0, count: int | None = None):
        self.dataset, self.seq_len, self.first = dataset, seq_len, first
        self.count = count if count is not None else len(dataset) - first

    def __len__(self) -> int:
        return self.count

    def item(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = self.dataset[self.first + index]
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise ValueError(f"data.builder's dataset[{self.first + index}] must be (inputs, labels), got {type(got).__name__}")
        inputs, labels = (torch.as_tensor(x) for x in got)
        for name, t in (("inputs", inputs), ("labels", labels)):
            if tuple(t.shape) != (self.seq_len,) or t.is_floating_point() or t.is_complex():
                raise ValueError(
                    f"data.builder's dataset[{self.first + index}] {name}: expected integer token ids of shape ({self.seq_len},) (data.seq_len), "
                    f"got {t.dtype} {tuple(t.shape)}"
                )
        return inputs.long(), labels.long()

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.item(i) for i in indices]
        if not items:
            empty = torch.zeros((0, self.seq_len), dtype=torch.long)
            return empty, empty.clone()
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def batch_digest(inputs: torch.Tensor, labels: torch.Tensor) -> int:
    """Sum of each sample's CRC-32 (inputs then labels, int64 bytes): adds up over ranks whatever the layout.

    Step events carry it, so the tokens a step trained on can be checked
    against the corpus from outside the job.
    """
    x, y = inputs.to("cpu", torch.int64).numpy(), labels.to("cpu", torch.int64).numpy()
    return sum(zlib.crc32(y[i].tobytes(), zlib.crc32(x[i].tobytes())) for i in range(len(x)))


class GlobalSampler:
    """Maps a step to the sample indices of its global batch, through a per-epoch permutation.

    The position before `start_step` is `start_position`; each step after it
    consumes `global_batch` samples. A job that resumed from a checkpoint
    made with another global batch has its origin there.
    """

    def __init__(self, num_samples: int, seed: int, global_batch: int, start_step: int = 0, start_position: int = 0):
        self.num_samples = num_samples
        self.seed = seed
        self.global_batch = global_batch
        self.rebase(start_step, start_position)
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def rebase(self, step: int, position: int) -> None:
        """From now on, step `step` starts at sample position `position`."""
        self.start_step, self.start_position = step, position

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, 7919, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def cursor(self, step: int) -> int:
        """Global sample position before `step` (steps count from 0)."""
        return self.start_position + (step - self.start_step) * self.global_batch

    def global_indices(self, step: int) -> list[int]:
        out = []
        for pos in range(self.cursor(step), self.cursor(step + 1)):
            epoch, offset = divmod(pos, self.num_samples)
            out.append(int(self._order(epoch)[offset]))
        return out

    def rank_indices(self, step: int, dp_rank: int, dp: int) -> list[int]:
        """The contiguous slice of the step's global batch that data-parallel rank `dp_rank` of `dp` takes."""
        per_rank = self.global_batch // dp
        return self.global_indices(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]


# -- what the driver works out once -----------------------------------------------------------------------------------
@dataclass
class DataInfo:
    """The job's data as the driver resolved it: sample counts, identity, and where the ranks find the tokens.

    Ranks receive it as JSON (`RankSpec.data`), so a corpus is listed and
    indexed once per job, not once per rank.
    """

    train_samples: int
    eval_samples: int
    eval_first: int
    """Index of the eval split's first sample in its source (after the training samples when carved off the corpus)."""
    identity: dict
    index: dict | None = None
    eval_index: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "DataInfo":
        return cls(**data)


IDENTITY_FIELDS = {
    "kind": "data.kind",
    "path": "data.path",
    "files": "data.path's files (their list or sizes)",
    "column": "data.column",
    "dtype": "data.dtype",
    "eos_token": "data.eos_token",
    "builder": "data.builder",
    "args": "data.args",
    "seed": "data.seed",
    "seq_len": "data.seq_len",
    "samples": "the training samples (data.num_samples, data.eval_samples or the corpus)",
}
"""What a resume compares, and the field each names when it differs."""


def _split(cfg: JobConfig, available: int, where: str) -> tuple[int, int]:
    """(training samples, eval samples carved off the end) of a source holding `available` samples."""
    d, gb = cfg.data, cfg.training.global_batch
    carve = 0 if d.eval_path else d.eval_samples
    train = d.num_samples if d.num_samples is not None else available - carve
    if train + carve > available:
        want = f"data.num_samples ({d.num_samples})" if d.num_samples is not None else "the training samples"
        raise ConfigError(f"{want} plus data.eval_samples ({carve}) exceed the {available} samples of {where}")
    if train < gb:
        raise ConfigError(f"{where} has {train} training samples, fewer than one training.global_batch ({gb})")
    return train, carve


def _check_vocab(cfg: JobConfig, windows) -> None:
    """The first and last windows' tokens fit the model's vocabulary (its builder's): a wrong data.dtype or tokenizer shows here."""
    from elastic.recipe import model_vocab_size

    vocab = model_vocab_size(cfg.model)
    if vocab is None:
        return
    if cfg.data.eos_token is not None and cfg.data.eos_token >= vocab:
        raise ConfigError(f"data.eos_token ({cfg.data.eos_token}) is not below the model's vocabulary ({vocab})")
    sample = windows.windows([0, len(windows) - 1])
    if int(sample.max()) >= vocab:
        raise ConfigError(
            f"data.path: token id {int(sample.max())} is not below the model's vocabulary ({vocab}); check data.dtype and the tokenizer"
        )


def describe(cfg: JobConfig) -> DataInfo:
    """Resolve and check the job's data before any worker starts; ConfigError naming the field on any problem."""
    d = cfg.data
    identity = {"kind": d.kind, "seed": d.seed, "seq_len": d.seq_len}
    if d.kind == "synthetic":
        train = d.num_samples or SYNTHETIC_SAMPLES
        if train < cfg.training.global_batch:
            raise ConfigError(f"data.num_samples ({train}) is fewer than one training.global_batch ({cfg.training.global_batch})")
        return DataInfo(train, d.eval_samples, train, {**identity, "samples": train})
    if d.kind == "builder":
        dataset = open_builder(d)
        train, carve = _split(cfg, len(dataset), f"data.builder {d.builder}'s dataset")
        try:
            MapDataset(dataset, d.seq_len).item(0)
        except Exception as exc:  # noqa: BLE001 - the user's dataset failed: one line that says so
            raise ConfigError(str(exc) if isinstance(exc, ValueError) else f"data.builder's dataset[0] failed: {type(exc).__name__}: {exc}") from None
        identity.update(builder=d.builder, args=d.args, samples=train)
        return DataInfo(train, carve, len(dataset) - carve, identity)
    index = index_corpus(d.path, d)
    windows = windows_in(index.tokens, d.seq_len)
    train, carve = _split(cfg, windows, f"data.path {d.path!r} ({index.tokens} tokens)")
    _check_vocab(cfg, TokenWindows(TokenReader(index, d), d.seq_len, 0, windows))
    identity.update(path=d.path, files=index.fingerprint(), column=d.column, dtype=d.dtype, eos_token=d.eos_token, samples=train)
    info = DataInfo(train, carve, windows - carve, identity, index=index.to_json())
    if d.eval_path:
        eval_index = index_corpus(d.eval_path, d, "data.eval_path")
        available = windows_in(eval_index.tokens, d.seq_len)
        gb = cfg.training.global_batch
        info.eval_samples, info.eval_first = d.eval_samples or available, 0
        if info.eval_samples > available or available < gb:
            raise ConfigError(f"data.eval_path {d.eval_path!r} holds {available} windows: fewer than data.eval_samples or one training.global_batch ({gb})")
        info.eval_index = eval_index.to_json()
    return info


def open_builder(d: DataConfig):
    from elastic.plugins import resolve

    fn = resolve(d.builder, "data.builder")
    try:
        dataset = fn(**d.args)
    except Exception as exc:  # noqa: BLE001 - the user's builder failed: one line that says so
        raise ConfigError(f"data.builder {d.builder} failed: {type(exc).__name__}: {exc}") from None
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(f"data.builder {d.builder} returned {type(dataset).__name__}, not a map-style dataset (len and [index])")
    return dataset


def open_datasets(cfg: JobConfig, info: DataInfo, vocab_size: int | None = None):
    """A rank's (training dataset, eval dataset or None), each with `len` and `batch(indices) -> (inputs, labels)`.

    `vocab_size` is the model's (its spec's; default `model.vocab_size`): synthetic tokens are drawn below it.
    """
    d = cfg.data
    vocab_size = vocab_size or cfg.model.vocab_size
    if d.kind == "synthetic":
        train = SyntheticTokens(d, vocab_size, 0, info.train_samples)
        held = SyntheticTokens(d, vocab_size, info.eval_first, info.eval_samples)
    elif d.kind == "builder":
        dataset = open_builder(d)
        train = MapDataset(dataset, d.seq_len, 0, info.train_samples)
        held = MapDataset(dataset, d.seq_len, info.eval_first, info.eval_samples)
    else:
        reader = TokenReader(CorpusIndex.from_json(info.index), d)
        train = TokenWindows(reader, d.seq_len, 0, info.train_samples)
        held_reader = TokenReader(CorpusIndex.from_json(info.eval_index), d) if info.eval_index else reader
        held = TokenWindows(held_reader, d.seq_len, info.eval_first, info.eval_samples)
    return train, (held if info.eval_samples else None)


def resume_position(uri: str, step: int, info: DataInfo) -> int:
    """The sample position checkpoint `step` saved; ConfigError naming the field if the job's data is not the data it saved."""
    try:
        state = storage.read_manifest(uri, step)["train_state"]
    except storage.CheckpointError as exc:
        raise ConfigError(f"cannot resume: {exc}") from None
    saved = state.get("data")
    if not isinstance(saved, dict) or not isinstance(saved.get("position"), int) or not isinstance(saved.get("identity"), dict):
        raise ConfigError(f"cannot resume from step {step} of {uri}: its train_state has no data position (start afresh with --fresh)")
    for key, field in IDENTITY_FIELDS.items():
        was, now = saved["identity"].get(key), info.identity.get(key)
        if was != now:
            raise ConfigError(
                f"cannot resume from step {step} of {uri}: {field} changed ({_short(was)} -> {_short(now)}); "
                "the saved data position would point at other samples (start afresh with --fresh or another checkpoint.uri)"
            )
    return saved["position"]


def _short(value) -> str:
    """At most 60 characters of `repr(value)`: its start and its end, where two long paths differ most often."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:27]}...{text[-30:]}"
