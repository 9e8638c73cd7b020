"""`collect.integer_merge` (MindSpore's data-parallel merge: an int64 MAX and an int64 SUM
all-reduce) on 2, 4 and 16 simulated ranks (one thread each, the all-reduce a barrier and numpy's
max/sum): rows with nan, +-inf, -0.0, subnormals, sums that overflow, a tie broken by a tiny
term, values 2**-1074 to 2**1000 apart. On 2 ranks every merged column is bit-identical to
float64 addition; on more, the sums are the correctly rounded exact sums (`math.fsum`) but at
exact ties broken by terms over 2**57 below the largest (one unit in the last place); min/max
and counts exact, `ONCE` rows rank 0's, local rows the rank's own; the buffers do not grow with
the world; a rank with other keys fails on every rank (a new layout: at a check of its own first). The 2-rank `msrun` run of
tests/test_mindspore_distributed.py merges through it."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from msprobe_engine.collect.integer_merge import merge_rows
from msprobe_engine.stats.columns import P_MAX, P_MIN, merge_indices

K, LOCAL_ROWS = 300, 3
ONCE_ROWS = slice(20, 40)


def _every(world: int) -> np.ndarray:
    rng = np.random.default_rng(world)
    every = rng.standard_normal((world, K, 8)) * np.ldexp(1.0, rng.integers(-1074, 1000, (world, K, 8)))
    every[:, :12] = rng.standard_normal((world, 12, 8))
    every[0, 1, 2], every[1, 2, 2], every[0, 3, 2], every[1, 3, 2] = np.nan, np.inf, -np.inf, np.inf
    every[:, 4, 2], every[0, 5, 2], every[1, 5, 2] = -0.0, -0.0, 0.0
    every[:, 6, 2], every[:, 7, 2] = 1.7e308, 5e-324  # overflows to inf; subnormals add
    every[0, 8, 2], every[1, 8, 2] = 1.0, 2.0 ** -60
    every[0, 9, 2], every[1, 9, 2] = 1.0, -1.0  # an exact 0: +0.0
    every[0, 10, 2], every[1, 10, 2] = 1.0, 2.0 ** -53  # a tie: to even
    every[:, 11, P_MIN] = -0.0
    return every


def _run(every: np.ndarray, keys_of=lambda rank: 123, new_layout: bool = False) -> tuple[list, list[int]]:
    """Every rank's merged rows (or its error) and the sizes of the buffers rank 0 all-reduced."""
    world = len(every)
    barrier, box, sizes, outs = threading.Barrier(world), {}, [], [None] * world
    sent = np.arange(K) < K - LOCAL_ROWS
    once = np.zeros(K, bool)
    once[ONCE_ROWS] = True

    def body(rank: int) -> None:
        def all_reduce(values: np.ndarray, op: str) -> np.ndarray:
            box[rank] = values.copy()
            if rank == 0:
                sizes.append(values.nbytes)
            barrier.wait()
            stacked = np.stack([box[r] for r in range(world)])
            reduced = stacked.max(axis=0) if op == "max" else stacked.sum(axis=0)
            barrier.wait()
            return reduced

        try:
            outs[rank] = merge_rows(every[rank].copy(), sent, ~once | (rank == 0), keys_of(rank), world, all_reduce,
                                    new_layout=new_layout)
        except RuntimeError as exc:
            outs[rank] = str(exc)

    threads = [threading.Thread(target=body, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outs, sizes


def _bits(value: float) -> int:
    return int(np.float64(value).view(np.int64)) if not math.isnan(value) else -1


@pytest.fixture(scope="module")
def merged() -> dict:
    return {world: (_every(world), *_run(_every(world))) for world in (2, 4, 16)}


def test_two_ranks_are_bit_identical_to_float64_addition(merged):
    every, outs, _ = merged[2]
    with np.errstate(over="ignore", invalid="ignore"):
        want = every[0] + every[1]
    want[:, P_MIN] = np.minimum(every[0][:, P_MIN], every[1][:, P_MIN])
    want[:, P_MAX] = np.maximum(every[0][:, P_MAX], every[1][:, P_MAX])
    want[ONCE_ROWS] = every[0][ONCE_ROWS]
    for rank, out in enumerate(outs):
        got = out[:K - LOCAL_ROWS]
        differ = [(i, c) for i, c in zip(*np.nonzero(got.view(np.int64) != want[:K - LOCAL_ROWS].view(np.int64)))
                  if not (math.isnan(got[i, c]) and math.isnan(want[i, c]))
                  and not (c in (P_MIN, P_MAX) and got[i, c] == want[i, c] == 0)]  # (numpy's signed zeros)
        assert differ == []
        assert np.array_equal(out[K - LOCAL_ROWS:], every[rank][K - LOCAL_ROWS:])  # local: its own
    assert _bits(outs[0][4, 2]) == _bits(-0.0) and _bits(outs[0][5, 2]) == _bits(0.0)
    assert _bits(outs[0][11, P_MIN]) == _bits(-0.0)  # -0.0 below +0.0 in the min
    assert outs[0][6, 2] == math.inf and math.isnan(outs[0][3, 2]) and outs[0][10, 2] == 1.0


@pytest.mark.parametrize("world", [4, 16])
def test_more_ranks_give_the_correctly_rounded_sum(merged, world):
    every, outs, _ = merged[world]
    off = compared = 0
    for i in range(K - LOCAL_ROWS):
        for c in merge_indices("sum"):
            values = [every[0, i, c]] if ONCE_ROWS.start <= i < ONCE_ROWS.stop else list(every[:, i, c])
            got = outs[0][i, c]
            if not all(map(math.isfinite, values)) or max(map(abs, values)) > 1e306:  # (no overflow)
                continue
            want = math.fsum(values)
            compared += 1
            if _bits(got) != _bits(want):
                assert got == want or math.ulp(want) == abs(got - want), (i, c, got, want)  # a tie, broken
                off += 1
    assert off <= compared // 100  # rare: the few ties among values 2**-1074 to 2**1000 apart
    sent = slice(0, K - LOCAL_ROWS)  # the same bits on every rank
    assert all(np.array_equal(out[sent], outs[0][sent], equal_nan=True) for out in outs)
    assert np.array_equal(outs[0][:K - LOCAL_ROWS, P_MAX], _max_of(every)[:K - LOCAL_ROWS], equal_nan=True)


def _max_of(every: np.ndarray) -> np.ndarray:
    """The merged max column: rank 0's for the once rows."""
    out = every[:, :, P_MAX].max(axis=0)
    out[ONCE_ROWS] = every[0, ONCE_ROWS, P_MAX]
    return out


def test_the_buffers_do_not_grow_with_the_world(merged):
    assert merged[2][2] == merged[4][2] == merged[16][2]  # one MAX, one SUM, the same sizes
    assert len(merged[2][2]) == 2


def test_ranks_measuring_different_keys_fail_on_every_rank():
    outs, sizes = _run(_every(2), keys_of=lambda rank: 123 + rank, new_layout=True)
    assert all("measured different tensors" in out for out in outs)
    assert sizes == [4 * 8]  # a new layout: the check alone first, then nothing more


def test_nothing_sent_is_one_max_and_the_rows_kept():
    rows = _every(2)[:, :LOCAL_ROWS]
    barrier, calls = threading.Barrier(2), []

    def all_reduce(values: np.ndarray, op: str) -> np.ndarray:
        calls.append(op)
        barrier.wait()
        return values

    outs = [None, None]

    def body(rank: int) -> None:
        outs[rank] = merge_rows(rows[rank], np.zeros(LOCAL_ROWS, bool), np.ones(LOCAL_ROWS, bool), 1, 2, all_reduce)

    threads = [threading.Thread(target=body, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == ["max", "max"] and all(np.array_equal(outs[r], rows[r], equal_nan=True) for r in (0, 1))
