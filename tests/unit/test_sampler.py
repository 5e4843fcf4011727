"""The global-order sampler gives every process count the same samples per step."""

from __future__ import annotations

import pytest

from framework.data.sampler import GlobalOrderSampler


def rank_batches(n, world, batch, seed=0, epoch=0, drop_last=True, shuffle=True):
    shards = []
    for rank in range(world):
        s = GlobalOrderSampler(
            n, shuffle=shuffle, seed=seed, drop_last=drop_last, num_replicas=world, rank=rank
        )
        s.set_epoch(epoch)
        idx = list(s)
        assert len(idx) == len(s)
        shards.append([idx[i : i + batch] for i in range(0, len(idx), batch)])
    return shards


@pytest.mark.parametrize("world", [2, 3, 4])
def test_union_of_rank_batches_is_the_single_process_batch(world):
    single = rank_batches(101, 1, 12)[0]
    per_rank = rank_batches(101, world, 12 // world)
    for step in range(len(per_rank[0]) - 1):
        union = sorted(i for r in range(world) for i in per_rank[r][step])
        assert union == sorted(single[step])


def test_order_depends_on_seed_and_epoch_only():
    a = list(GlobalOrderSampler(50, seed=1, num_replicas=1, rank=0))
    b = list(GlobalOrderSampler(50, seed=1, num_replicas=1, rank=0))
    c = list(GlobalOrderSampler(50, seed=2, num_replicas=1, rank=0))
    s = GlobalOrderSampler(50, seed=1, num_replicas=1, rank=0)
    s.set_epoch(1)
    assert a == b and a != c and list(s) != a
    assert sorted(a) == list(range(50))


def test_evaluation_order_pads_to_equal_lengths_and_covers_all():
    shards = [
        list(GlobalOrderSampler(10, shuffle=False, drop_last=False, num_replicas=4, rank=r))
        for r in range(4)
    ]
    assert {len(s) for s in shards} == {3}
    assert set().union(*shards) == set(range(10))


def test_start_offset_skips_consumed_samples():
    full = list(GlobalOrderSampler(40, seed=3, num_replicas=1, rank=0))
    s = GlobalOrderSampler(40, seed=3, num_replicas=2, rank=1)
    s.resume_at(0, 10)
    assert list(s) == full[10:][1::2]
    s.set_epoch(1)
    assert len(list(s)) == 20, "the offset applies to the resumed epoch only"
