"""Vectorised comparison metrics of two tensors and of two sets of dump statistics.

Tensors are walked in fixed-size chunks copied into reused float64 work buffers (so the extra
memory is a few chunks whatever the tensor size), and every metric is computed from those
float64 values: the products of float32 (or narrower) values are exact in float64 and the sums
accumulate in float64, so the results agree with a float64 reference to rounding.
The inputs may be numpy arrays or torch tensors (any dtype torch or numpy can cast to float64:
bfloat16 and float16 are converted chunk by chunk, never as a whole); torch is not imported here.
nan/inf positions are compared by class (nan with nan, +inf with +inf): a differing class counts
in ``nonfinite_mismatch``; the other metrics use the positions where both values are finite.
"""
from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from msprobe_engine.dump.schema import STAT_KEYS
from msprobe_engine.registry import framework_of, load_framework

CHUNK = 1 << 18  # elements; 3 float64 buffers of 2 MiB and a 256 KiB mask per thread
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


class _Buffers:
    """Three float64 rows (a, b, b - a) and a bool row of one chunk, with torch views of the
    float rows made on first use by a torch input. One set per chunk size and thread."""

    _local = threading.local()

    def __init__(self, chunk: int) -> None:
        self.f64 = np.empty((3, chunk))
        self.mask = np.empty(chunk, bool)
        #: framework name -> its copier into `f64` (`Framework.numpy_copier`), made on first use
        self.copiers: dict[str, Callable[[int, Any], None]] = {}

    @classmethod
    def get(cls, chunk: int) -> _Buffers:
        cached = getattr(cls._local, "by_size", None)
        if cached is None or chunk not in cached:
            cached = cls._local.by_size = {chunk: cls(chunk)}  # keep one size only: bounded memory
        return cached[chunk]


def _framework(x: Any) -> str | None:
    """The framework of a tensor (None: a numpy array or a number)."""
    return None if isinstance(x, np.ndarray) else framework_of(x)


class _Sums:
    """Running sums and extremes over chunks."""

    def __init__(self, buffers: _Buffers) -> None:
        self.aa = self.bb = self.ab = self.dd = 0.0
        self.max_abs = self.max_rel = 0.0
        self.within1 = self.within5 = self.mismatch = 0
        self.buf = buffers

    def add_chunk(self, a_in: Any, b_in: Any) -> None:
        """Add one chunk (numpy arrays or 1-D torch tensors of the same length)."""
        n = len(a_in)
        a, b = self.buf.f64[0, :n], self.buf.f64[1, :n]
        framework = _framework(a_in)
        if framework is not None:
            copy = self.buf.copiers.get(framework)
            if copy is None:  # the framework is imported already: whoever made the tensor did
                copy = self.buf.copiers[framework] = load_framework(framework).numpy_copier(self.buf.f64)
            copy(0, a_in)
            copy(1, b_in)
        else:
            np.copyto(a, a_in, casting="unsafe")
            np.copyto(b, b_in, casting="unsafe")
        aa, bb = float(np.dot(a, a)), float(np.dot(b, b))
        if math.isfinite(aa) and math.isfinite(bb):  # no nan/inf in the chunk
            self._add_finite(a, b, self.buf.f64[2, :n], aa, bb)
            return
        finite = np.isfinite(a) & np.isfinite(b)
        same_class = (a == b) | (np.isnan(a) & np.isnan(b))
        equal_nonfinite = int(np.count_nonzero(~finite & same_class))
        self.mismatch += int(np.count_nonzero(~finite & ~same_class))
        self.within1 += equal_nonfinite
        self.within5 += equal_nonfinite
        a, b = a[finite], b[finite]
        self._add_finite(a, b, self.buf.f64[2, :a.size], float(np.dot(a, a)), float(np.dot(b, b)))

    def _add_finite(self, a: np.ndarray, b: np.ndarray, d: np.ndarray, aa: float, bb: float) -> None:
        """Add float64 chunks of finite values (``a``, ``b`` and ``d`` are overwritten)."""
        n = a.size
        if n == 0:
            return
        np.subtract(b, a, out=d)
        self.aa += aa
        self.bb += bb
        self.ab += float(np.dot(a, b))
        self.dd += float(np.dot(d, d))
        np.abs(d, out=d)
        np.abs(a, out=a)
        self.max_abs = max(self.max_abs, float(d.max()))
        rel = b  # b is no longer needed: rel = |b - a| / |a|, 0/0 -> nan (equal values), x/0 -> inf
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(d, a, out=rel)
        top = float(np.fmax.reduce(rel))  # nan only where both are 0, which fmax skips
        if top != top:  # every element 0/0: a == b == 0 throughout
            self.within1 += n
            self.within5 += n
            return
        self.max_rel = max(self.max_rel, top)
        # within a ratio <=> not (rel > ratio): nan (0/0) counts as within, as it should.
        # A ratio at or above the chunk's largest rel needs no pass: every element is within.
        outside1 = 0 if top <= THOUSANDTH else int(np.count_nonzero(np.greater(rel, THOUSANDTH, out=self.buf.mask[:n])))
        outside5 = 0 if top <= FIVE_THOUSANDTH or outside1 == 0 else \
            int(np.count_nonzero(np.greater(rel, FIVE_THOUSANDTH, out=self.buf.mask[:n])))
        self.within1 += n - outside1
        self.within5 += n - outside5


def _cosine(aa: float, bb: float, ab: float) -> float:
    if aa == 0 and bb == 0:
        return 1.0
    if aa == 0 or bb == 0:
        return 0.0
    return max(-1.0, min(1.0, ab / math.sqrt(aa * bb)))


def _flat(x: Any) -> Any:
    if _framework(x) is not None:
        return x.reshape(-1)  # a view when contiguous (a loaded tensor is)
    return np.ravel(x)


def tensor_metrics(a: Any, b: Any, chunk: int = CHUNK) -> TensorMetrics:
    """Compare target ``b`` with baseline ``a`` (same number of elements; any numeric or bool dtype).

    ``a`` and ``b`` are numpy arrays or torch tensors (CPU). Two all-zero tensors have cosine 1,
    one all-zero tensor against another tensor cosine 0; an empty pair compares as identical.
    """
    flat_a, flat_b = _flat(a), _flat(b)
    n = len(flat_a)
    if n != len(flat_b):
        raise ValueError(f"element counts differ: {n} vs {len(flat_b)}")
    sums = _Sums(_Buffers.get(chunk))
    for start in range(0, n, chunk):
        sums.add_chunk(flat_a[start:start + chunk], flat_b[start:start + chunk])
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
