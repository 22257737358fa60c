import torch
import torch.distributed as dist

from distributed import run_distributed


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t


def test_harness_all_reduce():
    assert [r.item() for r in run_distributed(_sum_ranks, 2)] == [1.0, 1.0]
