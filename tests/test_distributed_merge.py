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


def _grid(rank: int, world: int) -> dict:
    """A 2 x 2 grid: tensor-parallel pairs {0, 1}, {2, 3}, data-parallel pairs {0, 2}, {1, 3}.
    The same rows merged over both (every tensor x data policy pair, replicated `AUTO` rows in both
    pairs, in one only, in none) in one pair of all-reduces over the world (`NestedMerge` with a
    stage) and group by group (without one); the rank holding the most nan named by its global
    rank on every rank, out of 4."""
    import itertools

    import torch
    import torch.distributed as dist

    from msprobe_engine.frameworks.torch import distributed as torch_distributed
    from msprobe_engine.frameworks.torch.distributed import AUTO, MERGE, ONCE, NestedMerge
    from msprobe_engine.stats.columns import P_INF, P_NAN, P_NUMEL
    from msprobe_engine.stats.ranks import RankSpread
    from msprobe_engine.stats.table import MetricKey

    dist.init_process_group("gloo")
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, dp_group = tp_groups[rank // 2], dp_groups[rank % 2]
    pairs = list(itertools.product((MERGE, ONCE, AUTO), (MERGE, ONCE))) * 3
    keys = [MetricKey("grad" if tp != AUTO else "actv", f"m{i}") for i, (tp, _) in enumerate(pairs)]
    policy = {key: pair for key, pair in zip(keys, pairs)}
    gen = torch.Generator().manual_seed(0)
    every = torch.randn(world, len(keys), 8, generator=gen, dtype=torch.float64)
    every[:, :, 4:] = torch.randint(0, 100, (world, len(keys), 4), generator=gen).double()
    every[1, 0, 0] = float("nan")
    every[:, :, P_INF] = 0.0
    auto = torch.tensor([tp == AUTO for tp, _ in pairs])
    every[:, :, P_NAN] = torch.where(auto, 0.0, torch.tensor([0.0, 2.0, 0.0, 5.0])[:, None])
    for i, (tp, _) in enumerate(pairs):
        copies = 2 if i < len(pairs) // 3 else (1 if i < 2 * len(pairs) // 3 else 0)  # pairs holding copies
        for pair in range(copies) if tp == AUTO else ():
            every[2 * pair + 1, i] = every[2 * pair, i]
    parts = [(tp_group, "tensor", lambda key: policy[key][0]), (dp_group, "data", lambda key: policy[key][1])]
    calls = []
    original = torch_distributed._all_reduce

    def counting(*args, **kwargs):
        calls.append(kwargs["group"])
        return original(*args, **kwargs)

    torch_distributed._all_reduce = counting
    try:
        whole, chain = NestedMerge(parts, stage=dist.group.WORLD), NestedMerge(parts)
        at_once = whole(keys, every[rank].clone())
        one_call = len(calls)
        by_group = chain(keys, every[rank].clone())
        chain_calls = len(calls) - one_call
        # AUTO over both parts (tensor, then context parallel): not in one pair, group by group
        both = [(group, what, lambda key: AUTO) for group, what, _ in parts]
        before = len(calls)
        auto_twice = NestedMerge(both, stage=dist.group.WORLD)(keys, every[rank].clone())
        auto_calls = len(calls) - before
        auto_chain = NestedMerge(both)(keys, every[rank].clone())
    finally:
        torch_distributed._all_reduce = original
    spread = RankSpread.of(whole.last.spread.tolist())
    whole_group = calls[0] is dist.group.WORLD
    third = len(pairs) // 3  # replicated in the first tensor-parallel pair only, merged over data: the
    # copy is counted too (over the world the copies of every pair count, or of none)
    mixed = {i: every[0, i, P_NUMEL].item() for i, pair in enumerate(pairs) if pair == (AUTO, MERGE) and third <= i < 2 * third}
    dist.destroy_process_group()
    return {"holder": spread.nonfinite_holder(), "most": spread.get("nonfinite", "max"), "world": spread.world,
            "holders": spread.values["holders"], "nan_count": at_once[0, P_NAN].item(),
            "calls": (one_call, chain_calls), "whole_group": whole_group,
            "at_once": at_once.tolist(), "by_group": by_group.tolist(), "mixed": mixed,
            "auto_twice": (auto_calls, bool(((auto_twice == auto_chain) | (auto_twice.isnan() & auto_chain.isnan())).all())),
            "chain_spread": RankSpread.of(chain.last.spread.tolist()).values, "spread": spread.values}


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    return run_ranks(_grid, 4, timeout=120)


@pytest.mark.slow
def test_a_rank_is_named_through_a_tensor_then_data_parallel_merge(grid):
    for result in grid:
        assert {k: result[k] for k in ("holder", "most", "world", "holders", "nan_count")} == {
            "holder": 3, "most": 5.0 * 12, "world": 4, "holders": 2.0, "nan_count": 7.0}


@pytest.mark.slow
def test_two_groups_merge_in_one_pair_of_all_reduces_as_group_by_group(grid):
    import torch

    from msprobe_engine.stats.columns import P_NUMEL, P_SUM, P_SUMSQ

    for result in grid:
        assert result["calls"] == (2, 4) and result["whole_group"]  # one SUM + one MAX over the world
        at_once, by_group = (torch.tensor(result[k], dtype=torch.float64) for k in ("at_once", "by_group"))
        same = (at_once.view(torch.int64) == by_group.view(torch.int64)) | (at_once.isnan() & by_group.isnan())
        rows = [i for i in range(len(at_once)) if i not in result["mixed"]]
        bad = [(rows[i], c) for i, c in (~same[rows]).nonzero().tolist() if c not in (P_SUM, P_SUMSQ)]
        assert not bad, bad  # counts, minima, maxima, once/auto choices bit-identical
        assert result["auto_twice"] == (4, True)  # a pair per part, as without a stage
        # float sums: 4 terms of |x| < 10, added in gloo's order: a few units in the last place
        assert torch.allclose(at_once[rows], by_group[rows], rtol=0, atol=1e-14, equal_nan=True)
        assert result["mixed"]
        for i, copy in result["mixed"].items():
            assert at_once[i, P_NUMEL] == by_group[i, P_NUMEL] + copy
        assert result["spread"] == pytest.approx(result["chain_spread"], rel=1e-15, nan_ok=True)
    bits = [torch.tensor(r["at_once"], dtype=torch.float64).view(torch.int64) for r in grid]
    assert all(torch.equal(b, bits[0]) for b in bits)  # every rank holds the same merged bits


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
