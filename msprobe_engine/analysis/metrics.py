"""Vectorised comparison metrics of two tensors and of two sets of dump statistics.

Tensors are walked in fixed-size chunks converted to float64 into reused buffers, so the extra
memory is a few chunks whatever the tensor size. nan/inf positions are compared by class (nan with nan,
+inf with +inf): a differing class counts in ``nonfinite_mismatch``; the other metrics use
the positions where both values are finite.
"""
from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass

import numpy as np

from msprobe_engine.dump.schema import STAT_KEYS

CHUNK = 1 << 16
THOUSANDTH = 0.001
FIVE_THOUSANDTH = 0.005


@dataclass(frozen=True, slots=True)
class TensorMetrics:
    """Metrics of target B against baseline A (relative error = |b - a| / |a|)."""
    cosine: float
    max_abs_err: float
    max_rel_err: float
    one_thousandth_ratio: float
    five_thousandth_ratio: float
    euclidean_distance: float
    nonfinite_mismatch: int
    numel: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def relative_error(a: float, b: float) -> float:
    """|b - a| / |a|; 0 when both are 0, inf when only a is 0, nan when either is nan."""
    diff = abs(b - a)
    if diff == 0:
        return 0.0
    return math.inf if a == 0 else diff / abs(a)


class _Sums:
    """Running sums over chunks, computed in float64 work buffers reused across chunks
    (allocated once per chunk size and thread, so the loop does not allocate)."""

    _buffers = threading.local()

    def __init__(self, chunk: int) -> None:
        self.aa = self.bb = self.ab = self.dd = 0.0
        self.max_abs = self.max_rel = 0.0
        self.within1 = self.within5 = self.mismatch = 0
        cached = getattr(self._buffers, "by_size", {})
        if chunk not in cached:
            cached = self._buffers.by_size = {chunk: ([np.empty(chunk) for _ in range(4)], np.empty(chunk, bool))}
        self._f64, self._mask = cached[chunk]

    def _add_finite(self, a: np.ndarray, b: np.ndarray, aa: float, bb: float) -> None:
        """Add float64 chunks holding finite values only (``a`` and ``b`` are overwritten)."""
        n = a.size
        if n == 0:
            return
        d, t, m = self._f64[2][:n], self._f64[3][:n], self._mask[:n]
        np.subtract(b, a, out=d)
        self.aa += aa
        self.bb += bb
        self.ab += float(np.dot(a, b))
        self.dd += float(np.dot(d, d))
        np.abs(d, out=d)
        np.abs(a, out=a)
        self.max_abs = max(self.max_abs, float(d.max()))
        for ratio, attr in ((THOUSANDTH, "within1"), (FIVE_THOUSANDTH, "within5")):
            np.multiply(a, ratio, out=t)
            np.less_equal(d, t, out=m)
            setattr(self, attr, getattr(self, attr) + int(np.count_nonzero(m)))
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(d, a, out=t)  # 0/0 -> nan (ignored by fmax), x/0 -> inf
        rel = float(np.fmax.reduce(t))
        if not math.isnan(rel):
            self.max_rel = max(self.max_rel, rel)

    def add_chunk(self, a_in: np.ndarray, b_in: np.ndarray) -> None:
        n = a_in.size
        a, b = self._f64[0][:n], self._f64[1][:n]
        np.copyto(a, a_in, casting="unsafe")
        np.copyto(b, b_in, casting="unsafe")
        aa, bb = float(np.dot(a, a)), float(np.dot(b, b))
        if math.isfinite(aa) and math.isfinite(bb):  # no nan/inf in the chunk
            self._add_finite(a, b, aa, bb)
            return
        finite = np.isfinite(a) & np.isfinite(b)
        same_class = (a == b) | (np.isnan(a) & np.isnan(b))
        equal_nonfinite = int(np.count_nonzero(~finite & same_class))
        self.mismatch += int(np.count_nonzero(~finite & ~same_class))
        self.within1 += equal_nonfinite
        self.within5 += equal_nonfinite
        a, b = a[finite], b[finite]
        self._add_finite(a, b, float(np.dot(a, a)), float(np.dot(b, b)))


def _cosine(aa: float, bb: float, ab: float) -> float:
    if aa == 0 and bb == 0:
        return 1.0
    if aa == 0 or bb == 0:
        return 0.0
    return max(-1.0, min(1.0, ab / math.sqrt(aa * bb)))


def tensor_metrics(a: np.ndarray, b: np.ndarray, chunk: int = CHUNK) -> TensorMetrics:
    """Compare target ``b`` with baseline ``a`` (same number of elements; any numeric or bool dtype).

    Two all-zero tensors have cosine 1, one all-zero tensor against another tensor cosine 0;
    an empty pair compares as identical.
    """
    flat_a, flat_b = np.ravel(a), np.ravel(b)
    if flat_a.size != flat_b.size:
        raise ValueError(f"element counts differ: {flat_a.size} vs {flat_b.size}")
    sums = _Sums(chunk)
    for start in range(0, flat_a.size, chunk):
        sums.add_chunk(flat_a[start:start + chunk], flat_b[start:start + chunk])
    n = flat_a.size
    return TensorMetrics(
        cosine=_cosine(sums.aa, sums.bb, sums.ab),
        max_abs_err=sums.max_abs,
        max_rel_err=sums.max_rel,
        one_thousandth_ratio=sums.within1 / n if n else 1.0,
        five_thousandth_ratio=sums.within5 / n if n else 1.0,
        euclidean_distance=math.sqrt(sums.dd),
        nonfinite_mismatch=sums.mismatch,
        numel=n,
    )


def stat_differences(stats_a: dict[str, float | None], stats_b: dict[str, float | None]) -> dict[str, float | None]:
    """For each of Max/Min/Mean/Norm: ``<key>_diff`` (B - A) and ``<key>_rel_err``; None where a side is null."""
    out: dict[str, float | None] = {}
    for key in STAT_KEYS:
        a, b = stats_a.get(key), stats_b.get(key)
        if a is None or b is None:
            out[f"{key}_diff"] = out[f"{key}_rel_err"] = None
        elif same_nonfinite(a, b):
            out[f"{key}_diff"] = out[f"{key}_rel_err"] = 0.0
        else:
            out[f"{key}_diff"] = b - a
            out[f"{key}_rel_err"] = relative_error(a, b)
    return out


def same_nonfinite(a: float, b: float) -> bool:
    """True when a and b are both nan, or the same infinity."""
    return (math.isnan(a) and math.isnan(b)) or (math.isinf(a) and a == b)


def nonfinite_disagree(a: float | None, b: float | None) -> bool:
    """True when exactly one side is nan/inf, or they are different non-finite values."""
    if a is None or b is None:
        return False
    if math.isfinite(a) and math.isfinite(b):
        return False
    return not same_nonfinite(a, b)
