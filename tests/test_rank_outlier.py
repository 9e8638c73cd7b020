"""The pieces of the world-independent merge and of `rank_outlier`, in one process: the order
keys (a MAX of int64 keys is the float max, nan included), the row hash, and the rule on
hand-made spreads (which rank, which reference, one firing per event)."""
from __future__ import annotations

import math

import pytest
import torch

from msprobe_engine.frameworks.torch.distributed import from_key, order_key, row_hash
from msprobe_engine.rules.rank_outlier import RankOutlierRule
from msprobe_engine.stats.ranks import NAMES, RankSpread
from msprobe_engine.stats import empty_rows
from msprobe_engine.stats.table import StatTable

VALUES = [-math.inf, -1e300, -2.5, -1e-310, -0.0, 0.0, 1e-310, 1.0, 2.0, 3e300, math.inf]


def test_order_keys_sort_as_the_floats_and_come_back_bit_for_bit():
    values = torch.tensor(VALUES, dtype=torch.float64)
    keys = order_key(values)
    assert keys.tolist() == sorted(keys.tolist()) and len(set(keys.tolist())) == len(VALUES)
    assert from_key(keys).view(torch.int64).tolist() == values.view(torch.int64).tolist()
    with_nan = order_key(torch.tensor([math.inf, -math.nan, 1.0], dtype=torch.float64))
    assert math.isnan(from_key(with_nan.max()).item())  # a nan on any rank wins the max


def test_the_row_hash_sees_every_bit():
    rows = torch.tensor([[1.0, 2.0, 0.0], [2.0, 2.0, 0.0], [1.0, 2.0, -0.0], [1.0, 2.0, 0.0]], dtype=torch.float64)
    hashes = row_hash(rows).tolist()
    assert hashes[0] == hashes[3] and len({hashes[0], hashes[1], hashes[2]}) == 3
    assert all(0 <= h < 2 ** 62 for h in hashes)


def _spread(world: int, **scalars) -> RankSpread:
    values = {name: 0.0 for name in NAMES}
    values["world"] = world
    for name, value in scalars.items():
        values[name.replace("__", "/")] = value
    return RankSpread(values)


def _fire(spread: RankSpread, factor: float = 10.0):
    table = StatTable([], empty_rows())
    table.ranks = spread
    rule = RankOutlierRule(RankOutlierRule.Config(rule="rank_outlier", factor=factor))
    return [(f.episode, f.tag, f.value) for f in rule.evaluate(table, {}, {})]


def test_one_high_gradient_norm_among_agreeing_ranks_is_named_against_the_middle_ones():
    # 8 ranks: seven hold 1.0, rank 5 holds 40.0
    spread = _spread(8, grad_norm__max=40.0, grad_norm__argmax=5, grad_norm__min=1.0, grad_norm__argmin=0,
                     grad_norm__sum=47.0)
    assert _fire(spread) == [("rank_outlier:grad_norm:high", "ranks/rank5/grad_norm", 40.0)]
    assert _fire(spread, factor=50.0) == []


def test_one_low_loss_is_named_and_agreeing_ranks_fire_nothing():
    low = _spread(4, loss__max=2.0, loss__argmax=0, loss__min=0.01, loss__argmin=3, loss__sum=6.01)
    assert _fire(low) == [("rank_outlier:loss:low", "ranks/rank3/loss", pytest.approx(200.0))]
    assert _fire(_spread(4, loss__max=2.0, loss__min=2.0, loss__sum=8.0)) == []


def test_the_rank_holding_the_most_nan_is_named_and_a_single_rank_fires_nothing():
    spread = _spread(4, nonfinite__max=7.0, nonfinite__argmax=2, holders=1.0)
    assert _fire(spread) == [("rank_outlier:nonfinite", "ranks/rank2/nonfinite", 7.0)]
    assert spread.nonfinite_sentence() == "rank 2 of 4 holds the nan"
    assert _fire(_spread(1, nonfinite__max=7.0)) == []
    table = StatTable([], empty_rows())  # no spread (one process, or none reported)
    assert RankOutlierRule(RankOutlierRule.Config(rule="rank_outlier")).evaluate(table, {}, {}) == []


def test_two_ranks_apart_are_one_event_named_by_the_higher():
    spread = _spread(2, grad_norm__max=40.0, grad_norm__argmax=1, grad_norm__min=1.0, grad_norm__argmin=0,
                     grad_norm__sum=41.0)
    assert _fire(spread) == [("rank_outlier:grad_norm:high", "ranks/rank1/grad_norm", 40.0)]
