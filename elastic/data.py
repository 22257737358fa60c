"""Deterministic synthetic tokens and the global sample cursor.

Every sample is a function of (seed, index) alone, and the order of samples
is a seeded permutation per epoch. A step consumes the next `global_batch`
positions of that order; each data-parallel rank takes its contiguous slice.
So any layout reads the same samples in the same step, and resuming at a
step reproduces the data position exactly, whatever the new world size.
"""

from __future__ import annotations

import numpy as np
import torch

from elastic.config import DataConfig

_STRIDES = np.array([1, 2, 3, 5])


class SyntheticTokens:
    """Arithmetic token sequences: token[j] = (start + stride * j) mod vocab, with rare noise.

    A model must read at least two tokens of context to know the stride, so the
    loss falls from ln(vocab) towards the noise floor as attention learns.
    """

    def __init__(self, cfg: DataConfig, vocab_size: int):
        self.cfg = cfg
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.cfg.num_samples

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.cfg.seed, index])
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


class GlobalSampler:
    """Maps a step to the sample indices of its global batch, through a per-epoch permutation."""

    def __init__(self, num_samples: int, seed: int, global_batch: int):
        self.num_samples = num_samples
        self.seed = seed
        self.global_batch = global_batch
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, 7919, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def cursor(self, step: int) -> int:
        """Global sample position before `step` (steps count from 0)."""
        return step * self.global_batch

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
