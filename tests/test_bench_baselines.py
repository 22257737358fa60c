"""The recovery benchmark's baselines (`bench/recovery.py`'s DPStep, which Ray Train and plain torch.distributed
run): they build and train the demo's model, and their DCP checkpoint restores the state exactly. A benchmark
whose baseline cannot start reports nothing to compare against."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.distributed import run_distributed  # noqa: E402


def _train_save_resume(rank: int, world: int, tmp: str) -> torch.Tensor:
    from bench.recovery import DPStep, load_cfg

    cfg = load_cfg("baseline", Path(tmp), world)
    first = DPStep(cfg, world, rank)
    first.step(0)
    first.save(f"{tmp}/dcp")
    after_save = first.step(1)
    resumed = DPStep(cfg, world, rank)
    resumed.load(f"{tmp}/dcp")
    return torch.tensor([after_save, resumed.step(1)], dtype=torch.float64)


def test_the_baselines_step_trains_and_its_dcp_checkpoint_resumes_bit_exact(tmp_path):
    for losses in run_distributed(_train_save_resume, 2, str(tmp_path)):
        assert torch.isfinite(losses).all()
        assert losses[0] == losses[1]  # the step after the checkpoint, run again from it
