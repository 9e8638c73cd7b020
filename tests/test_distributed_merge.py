"""`GroupMerge`'s all-reduces against the all-gather merge they replace, on 2 and 4 gloo ranks.

Random rows (nan, inf, -0.0, empty rows, replicated and nearly replicated `AUTO` rows) under
every policy: on 2 ranks the merged rows are bit-identical to the gathered merge's (min of mins,
max of maxes, sums in rank order, the first rank's row for `ONCE`, bit-equal `AUTO` rows once);
on 4 ranks counts, minima, maxima and `ONCE`/`LOCAL`/`AUTO` choices are, and the float sums agree
to the last bits (gloo adds in its own order), the same bits on every rank. The buffers do not
depend on the world size; ranks that measured different keys fail loudly."""
from __future__ import annotations

import pytest

from tests.multiproc import run_ranks

K = 40


def _gathered(stacked, policies, rows):
    """The all-gather merge as it was (rank order), for reference."""
    import torch

    from msprobe_engine.frameworks.torch.distributed import AUTO, LOCAL, ONCE
    from msprobe_engine.stats.columns import merge_indices

    merged = stacked.sum(dim=0)
    for kind, reduce in (("min", torch.amin), ("max", torch.amax)):
        at = merge_indices(kind)
        merged[:, at] = reduce(stacked[:, :, at], dim=0)
    once, local, auto = (torch.tensor([p == kind for p in policies]) for kind in (ONCE, LOCAL, AUTO))
    bits = stacked.view(torch.int64)
    once = once | (auto & (bits == bits[:1]).all(dim=2).all(dim=0))
    merged = torch.where(once[:, None], stacked[0], merged)
    return torch.where(local[:, None], rows, merged)


def _compare(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from msprobe_engine.frameworks.torch import distributed as torch_distributed
    from msprobe_engine.frameworks.torch.distributed import AUTO, LOCAL, MERGE, ONCE, GroupMerge
    from msprobe_engine.stats.columns import empty_row, merge_indices
    from msprobe_engine.stats.table import MetricKey

    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(0)
    every = torch.randn(world, K, 8, generator=gen, dtype=torch.float64)
    every[:, :, 4:] = torch.randint(0, 100, (world, K, 4), generator=gen).double()
    every[1, 3, 0] = float("nan")
    every[world - 1, 5, 1] = float("inf")
    every[0, 6, 1] = -0.0
    every[:, 7] = every[0, 7]  # replicated: AUTO takes it once
    every[:, 11] = every[0, 11]
    every[world - 1, 11, 2] += 1e-12  # one bit apart: AUTO merges it
    every[:, 12] = torch.tensor(empty_row(), dtype=torch.float64)
    policies = [MERGE, ONCE, LOCAL, AUTO] * (K // 4)
    keys = [MetricKey("grad" if i % 3 else "actv", f"p{i}") for i in range(K)]
    kind = dict(zip(keys, policies))
    sizes = []
    original = torch_distributed._all_reduce

    def counting(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    torch_distributed._all_reduce = counting
    try:
        got = GroupMerge(None)(keys, every[rank].clone(), kind.get)
        try:  # a rank that measured other keys (as many): refused on every rank
            other = [MetricKey("actv", f"q{rank}")] + keys[1:]
            GroupMerge(None)(other, every[rank].clone(), lambda key: MERGE)
            mismatch = "merged"
        except RuntimeError as exc:
            mismatch = str(exc)
    finally:
        torch_distributed._all_reduce = original
    want = _gathered(every.clone(), policies, every[rank])
    same = (got.view(torch.int64) == want.view(torch.int64)) | (got.isnan() & want.isnan())
    sums = merge_indices("sum")
    close = torch.isclose(got, want, rtol=1e-15, atol=0, equal_nan=True)
    dist.destroy_process_group()
    return {"differ": (~same).nonzero().tolist(), "close": bool(close.all()), "sums": sums, "sizes": sizes,
            "bits": got.view(torch.int64).tolist(), "local": [i for i, p in enumerate(policies) if p == LOCAL],
            "mismatch": mismatch}


def _two_groups(rank: int, world: int) -> dict:
    """A 2 x 2 grid: tensor-parallel pairs {0, 1}, {2, 3}, data-parallel pairs {0, 2}, {1, 3}; the
    data merge carries the tensor merge's spread on: the rank holding the most nan is named by its
    global rank on every rank, out of 4."""
    import torch
    import torch.distributed as dist

    from msprobe_engine.frameworks.torch.distributed import MERGE, GroupMerge
    from msprobe_engine.stats.columns import P_NAN
    from msprobe_engine.stats.ranks import RankSpread
    from msprobe_engine.stats.table import MetricKey

    dist.init_process_group("gloo")
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dp = GroupMerge(tp_groups[rank // 2], "tensor"), GroupMerge(dp_groups[rank % 2], "data")
    keys = [MetricKey("actv", f"m{i}") for i in range(6)]
    rows = torch.zeros(6, 8, dtype=torch.float64)
    rows[:, P_NAN] = {3: 5.0, 1: 2.0}.get(rank, 0.0)
    merged = dp(keys, tp(keys, rows, lambda key: MERGE), lambda key: MERGE, inner=tp)
    spread = RankSpread.of(dp.spread.tolist())
    dist.destroy_process_group()
    return {"holder": spread.nonfinite_holder(), "most": spread.get("nonfinite", "max"), "world": spread.world,
            "holders": spread.values["holders"], "nan_count": merged[0, P_NAN].item()}


@pytest.mark.slow
def test_a_rank_is_named_through_a_tensor_then_data_parallel_pair_of_merges():
    for result in run_ranks(_two_groups, 4, timeout=120):
        assert result == {"holder": 3, "most": 30.0, "world": 4, "holders": 2.0, "nan_count": 7.0}


@pytest.fixture(scope="module")
def merged() -> dict:
    return {world: run_ranks(_compare, world, timeout=120) for world in (2, 4)}


@pytest.mark.slow
def test_two_ranks_merge_bit_identically_to_the_gathered_merge(merged):
    for result in merged[2]:
        assert result["differ"] == []


@pytest.mark.slow
def test_four_ranks_differ_only_in_the_last_bits_of_float_sums(merged):
    for result in merged[4]:
        assert result["close"]
        assert all(col in (2, 3) for _, col in result["differ"]), result["differ"]  # sum, sumsq only
    shared = [[row for i, row in enumerate(r["bits"]) if i not in r["local"]] for r in merged[4]]
    assert all(bits == shared[0] for bits in shared)  # every rank holds the same merged bits


@pytest.mark.slow
def test_the_buffers_do_not_grow_with_the_world(merged):
    assert merged[2][0]["sizes"][:2] == merged[4][0]["sizes"][:2]
    assert len(merged[4][0]["sizes"]) == 4  # two all-reduces per merge (two merges here)


@pytest.mark.slow
def test_ranks_measuring_different_keys_fail_loudly(merged):
    for world in (2, 4):
        for result in merged[world]:
            assert "measured different tensors" in result["mismatch"]
