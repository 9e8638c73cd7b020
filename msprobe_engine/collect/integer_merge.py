"""The statistics merge on host rows through two integer all-reduces, for a backend without a
float64 SUM (MindSpore 2.10's CPU collectives: int64 SUM and MAX, no float64), exact and of a
size that does not depend on the world size.

1. MAX, int64: each row's max and -min as order-preserving keys (nan above +inf), and, of every
   sum-like column, the largest and smallest value the ranks contribute (the same keys): from
   those, the exponent `E` of the largest magnitude, and nan/inf/-0.0 as float64 addition
   gives them; the layout checksum and the key count and their negations.
2. SUM, int64: every finite sum-like value as a fixed-point integer `v * 2**(L*B - E)` cut into
   `L` limbs of `B` bits (`B` leaves room for `world` ranks' limbs to add without overflow;
   `L * B >= 110`: 2 limbs up to 128 ranks, 3 up to 2**25): the limb sums are the exact sum
   (bits more than 2**57 below the largest magnitude dropped), rounded to float64 once.

So counts are exact, min/max exact, and a sum is the correctly rounded sum of the ranks'
values, the same on every rank and in any order: bit-identical to float64 addition on two ranks
(the dropped bits of a value 2**57 below the other cannot move its rounding); on more, one unit
in the last place off at an exact tie that only the dropped bits would break.
Rows a rank does not give (a copy rank 0 gives) send the identities (the smallest key, zero
limbs); rows kept local are not sent. A layout's first step checks (checksum, count) in a MAX of
its own first (ranks with other key counts would send buffers of other sizes). Buffers: ``8 x (2 + 2s + 4/k)`` and ``8 x s x L`` bytes
per row (s sum-like columns) at any world size.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from msprobe_engine.stats.columns import merge_indices

#: flips the value bits of a negative float's pattern, so that integer order is float order
FLIP = (1 << 63) - 1
#: the smallest key: what a rank that contributes nothing to a maximum sends
NO_KEY = -(1 << 63)
#: bits a fixed-point window spans at least: 53 of the largest value and 57 below them (a value
#: 2**57 below another cannot move float64 rounding of their sum: its half-ulp is at most 2**-55 x)
_WINDOW = 110

AllReduce = Callable[[np.ndarray, str], np.ndarray]

_MISMATCH = ("msprobe: the ranks of the data-parallel group measured different tensors this step (different "
             "Cell calls, or not every rank reported a loss); their statistics cannot be merged. Every rank "
             "must run the same Cells and report alike.")


def order_key(values: np.ndarray) -> np.ndarray:
    """int64 keys in the order of float64 `values` (-0.0 below +0.0, every nan above +inf)."""
    bits = np.where(np.isnan(values), np.nan, values).astype(np.float64).view(np.int64)
    return np.where(bits < 0, bits ^ FLIP, bits)


def from_key(keys: np.ndarray) -> np.ndarray:
    """The float64 values of `order_key`'s keys."""
    return np.where(keys < 0, keys ^ FLIP, keys).view(np.float64)


def merge_rows(rows: np.ndarray, sent: np.ndarray, gives: np.ndarray, checksum: int, world: int,
               all_reduce: AllReduce, new_layout: bool = False) -> np.ndarray:
    """`rows` (``[k, n]`` float64, this rank's) merged over the ranks: `sent` rows (the others stay
    this rank's own) as every rank's that `gives` them (MERGE: all; ONCE: rank 0 only). Raises
    where the ranks measured different keys (`checksum`, count, in the MAX). `new_layout` (the first
    time this rank sees `checksum`): first a MAX of those four numbers alone, so that ranks with
    other key counts (other buffer sizes, whose all-reduce MindSpore refuses, one rank only after a
    timeout) fail at once; later, a failed all-reduce is raised as the same error.
    `all_reduce(int64 array, "max" | "sum")` is the backend's collective; called twice (once when
    nothing is sent; once more for a new layout)."""
    part = rows[sent]
    sums, maxes, mins = merge_indices("sum"), merge_indices("max"), merge_indices("min")
    values = part[:, sums]
    keys = np.concatenate([order_key(part[:, maxes]), order_key(-part[:, mins]), order_key(values),
                           order_key(-values)], axis=1)
    keys[~gives[sent]] = NO_KEY
    layout = np.array([checksum, len(rows), -checksum, -len(rows)], np.int64)
    if new_layout:
        _check(_reduce(all_reduce, layout, "max"))
    reduced = _reduce(all_reduce, np.concatenate([keys.ravel(), layout]), "max")
    _check(reduced[-4:])
    keys = reduced[:-4].reshape(keys.shape)
    mx, mn, s = len(maxes), len(mins), len(sums)
    high, low = from_key(keys[:, mx + mn:mx + mn + s]), -from_key(keys[:, mx + mn + s:])
    limb_bits = 62 - max(1, (world - 1).bit_length())
    window = limb_bits * -(-_WINDOW // limb_bits)
    with np.errstate(invalid="ignore"):
        largest = np.fmax(np.abs(high), np.abs(low))
    top = np.frexp(np.where(np.isfinite(largest), largest, 0.0))[1].astype(np.int64)
    given = np.where(gives[sent][:, None] & np.isfinite(values), values, 0.0)
    limbs = _limbs(given, window - top, limb_bits, window // limb_bits)
    out = rows.astype(np.float64, copy=True)
    if not len(part):  # per-rank rows only: no SUM, on every rank alike (MindSpore's fails when empty)
        return out
    totals = _reduce(all_reduce, limbs.ravel(), "sum").reshape(limbs.shape)
    merged = part.copy()
    merged[:, maxes] = from_key(keys[:, :mx])
    merged[:, mins] = -from_key(keys[:, mx:mx + mn])
    merged[:, sums] = _sums(totals, window - top, limb_bits, high, low)
    out[sent] = merged
    return out


def _check(layout: np.ndarray) -> None:
    """Raise unless every rank sent the same (checksum, count): the max of each is minus the max of its negation."""
    if (layout[:2] != -layout[2:]).any():
        raise RuntimeError(_MISMATCH)


def _reduce(all_reduce: AllReduce, values: np.ndarray, op: str) -> np.ndarray:
    """`all_reduce(values, op)`; its failure (MindSpore's on buffers of other sizes, at this call or
    the next one on a rank that waited) raised as the layout error."""
    try:
        return all_reduce(values, op)
    except RuntimeError as exc:
        raise RuntimeError(_MISMATCH + f" (the all-reduce failed: {str(exc).splitlines()[0]}; the ranks' "
                           "buffers differ in size where they measured different numbers of tensors)") from exc


def _limbs(values: np.ndarray, scale: np.ndarray, bits: int, count: int) -> np.ndarray:
    """``[..., count]`` signed limbs (lowest first) of ``values * 2**scale`` truncated to an integer."""
    mantissa, exponent = np.frexp(values)
    whole = np.abs(np.ldexp(mantissa, 53)).astype(np.int64)  # |values| = whole * 2**(exponent - 53)
    shift = exponent.astype(np.int64) - 53 + scale
    sign = np.where(values < 0, -1, 1)
    low = (1 << bits) - 1
    out = np.zeros(values.shape + (count,), np.int64)
    for i in range(count):
        at = shift - bits * i  # where bit 0 of `whole` lands in this limb
        up = np.clip(at, 0, 63)
        left = (whole & ((np.int64(1) << np.clip(bits - up, 0, 62)) - 1)) << up  # the bits below this limb's top
        right = whole >> np.clip(-at, 0, 63)
        piece = np.where(at >= 0, np.where(at < bits, left, 0), np.where(-at < 63, right & low, 0))
        out[..., i] = sign * piece
    return out


def _sums(totals: np.ndarray, scale: np.ndarray, bits: int, high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """The float64 sums of the limb sums `totals` (correctly rounded), with nan/inf/-0.0 as float
    addition makes them from the largest (`high`) and smallest (`low`) contributions."""
    upper = totals >> 31  # each limb sum as two exact float64 halves, scaled: math.fsum rounds once
    at = bits * np.arange(totals.shape[-1]) - scale[..., None]
    with np.errstate(over="ignore"):
        halves = np.concatenate([np.ldexp(upper.astype(np.float64), at + 31),
                                 np.ldexp((totals - (upper << 31)).astype(np.float64), at)], axis=-1)
    # (near the ends of the float64 range the halves round or overflow: there, exact integers)
    flat, tiny = halves.reshape(-1, halves.shape[-1]), ((scale > 900) | (scale < -800)).ravel()
    out = np.array([_rounded(_total(t, bits), int(n)) if small else math.fsum(h)
                    for h, t, n, small in zip(flat.tolist(), totals.reshape(flat.shape[0], -1).tolist(),
                                              scale.ravel().tolist(), tiny.tolist())]).reshape(high.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        special = np.where(np.isinf(high), high, low) + np.where(np.isinf(low), low, high)
    out = np.where(np.isfinite(high) & np.isfinite(low), out, special)  # nan, +-inf as float addition gives
    return np.where((out == 0) & np.signbit(high), -0.0, out)  # every contribution -0.0


def _total(limbs: list[int], bits: int) -> int:
    return sum(limb << (bits * i) for i, limb in enumerate(limbs))


def _rounded(total: int, scale: int) -> float:
    """``total * 2**-scale`` rounded to float64 once (inf past its range, as float addition)."""
    try:
        return total / (1 << scale) if scale >= 0 else float(total << -scale)
    except OverflowError:
        return math.copysign(math.inf, total)
