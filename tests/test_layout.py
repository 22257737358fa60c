import pytest

from elastic.config import load_config
from elastic.data import GlobalSampler
from elastic.layout import Layout, LayoutError
from elastic.policies import ScalingPolicy


def test_coords_roundtrip_and_tp_innermost():
    lay = Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    assert lay.world_size == 16 and lay.dp == 4
    for r in lay.ranks():
        assert lay.rank_of(**lay.coords(r)) == r
    assert [lay.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert lay.coords(15) == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert sorted({lay.dp_rank(r) for r in lay.ranks()}) == [0, 1, 2, 3]


def test_data_reporters_one_per_slice():
    lay = Layout(pp=2, dp_shard=3, tp=2)
    reporters = [r for r in lay.ranks() if lay.is_data_reporter(r)]
    assert len(reporters) == lay.dp
    assert sorted(lay.dp_rank(r) for r in reporters) == list(range(lay.dp))


@pytest.mark.parametrize("world, accum", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_global_batch_fixed_accumulation_adapts(world, accum):
    lay = Layout.for_world(world)
    assert lay.local_batch(32) * lay.dp == 32
    assert lay.grad_accum_steps(32, 4) == accum


def test_invalid_layouts():
    with pytest.raises(LayoutError):
        Layout(tp=0)
    with pytest.raises(LayoutError):
        Layout.for_world(6, tp=4)
    with pytest.raises(LayoutError):
        Layout(dp_shard=3).local_batch(32)


def test_slices_cover_global_batch_at_every_world_size():
    sampler = GlobalSampler(1000, 7, 12)
    for dp in (1, 2, 3, 4, 6, 12):
        got = [i for r in range(dp) for i in sampler.rank_indices(5, r, dp)]
        assert got == sampler.global_indices(5)
    assert len(set(sampler.global_indices(0) + sampler.global_indices(1))) == 24


def test_scaling_policy_largest_valid_world():
    cfg = load_config("deploy/examples/demo.yaml")
    policy = ScalingPolicy(cfg)
    assert policy.decide(4, None).layout.world_size == 4
    assert policy.decide(3, None).layout.world_size == 2  # dp=3 does not divide the global batch 32
    assert policy.decide(9, None).layout.world_size == 4  # capped at max_workers
    d = policy.decide(1, None)
    assert d.layout is None and "min_workers" in d.reason
