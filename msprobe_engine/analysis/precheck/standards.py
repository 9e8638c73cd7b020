"""Per-dtype precision standards: one output of the device run judged against the float64 benchmark.

The verdict follows the predecessor's run_ut standard (its ``accuracy_checking_details`` rows):

- integer and bool outputs: exact; any differing element is an ``error`` (error rate column);
- floating outputs: a mismatch in where inf/nan appear is an ``error``; cosine similarity
  <= 0.99 is an ``error`` (not measured where both sides are all below 1e-6 in magnitude:
  rounding noise around an exact zero); a max absolute error < 0.001 is a ``pass``; otherwise the share of
  elements with a relative error under a threshold decides: float16/bfloat16 need 99% under
  1/100 (else ``error``) and 99.9% under 1/1000 (else ``warning``); float32/float64 need 99.9%
  under 1/1000 (else ``error``) and 99.99% under 1/10000 (else ``warning``).

The other detail columns (error balance, RMSE, small-value error share, relative errors, ULP
errors) are measured for every floating output as the predecessor's newer standards define
them, and reported; they do not change the verdict. The two columns of the predecessor's
float8 absolute-threshold standard (相对误差错误率, 绝对误差错误率) stay blank: its
``api_precision_compare`` reads a filled 相对误差错误率 as "the input was float8".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PASS, WARNING, ERROR, SKIP = "pass", "warning", "error", "SKIP"
SPACE = " "
_RANK = {SPACE: 0, PASS: 1, SKIP: 1, WARNING: 2, ERROR: 3}
LOW_PRECISION = ("float16", "bfloat16")
#: machine epsilon per dtype name (bfloat16 has no numpy type)
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -23, "float64": 2.0 ** -52}
#: (smallest normal exponent, mantissa bits) for the ULP error, as the predecessor measures it
ULP = {"float16": (-14, 10), "bfloat16": (-126, 7), "float32": (-126, 23)}
#: |bench| at or below this is a "small value": judged by absolute error (predecessor's values)
SMALL_VALUE = {"float16": (1e-3, 1e-5), "bfloat16": (1e-3, 1e-5), "float32": (1e-6, 1e-9)}
COSINE_MIN = 0.99
#: (relative error, status when more than that share of elements exceed it), in order; by
#: whether the dtype is low precision (float16/bfloat16)
RATIO_RULES = {True: ((1e-2, ERROR), (1e-3, WARNING)), False: ((1e-3, ERROR), (1e-4, WARNING))}
RATIO_COLUMNS = {1e-2: "rel_err_hundredth", 1e-3: "rel_err_thousandth", 1e-4: "rel_err_ten_thousandth"}
#: outputs whose values all lie below this are rounding noise around zero: no cosine is taken
NOISE = 1e-6
MAX_ABS_PASS = 1e-3

#: the detail columns after "API Name" (the predecessor's accuracy_checking_details header)
DETAIL_COLUMNS = ("Bench Dtype", "DEVICE Dtype", "Shape", "余弦相似度", "最大绝对误差", "双百指标", "双千指标",
                  "双万指标", "二进制一致错误率", "误差均衡性", "均方根误差", "小值域错误占比", "相对误差最大值",
                  "相对误差平均值", "inf/nan错误率", "相对误差错误率", "绝对误差错误率", "ULP误差最大值",
                  "ULP误差平均值", "ULP误差大于阈值占比", "Status", "Message")
_METRICS = ("cosine_sim", "max_abs_err", "rel_err_hundredth", "rel_err_thousandth", "rel_err_ten_thousandth",
            "error_rate", "eb", "rmse", "small_value_err_ratio", "max_rel_error", "mean_rel_error",
            "inf_nan_error_ratio", "rel_err_ratio", "abs_err_ratio", "max_ulp_error", "mean_ulp_error",
            "ulp_error_proportion")


@dataclass
class OutputCheck:
    """The verdict on one output tensor (or value) and the metrics behind it."""
    status: str
    message: str = ""
    bench_dtype: str = SPACE
    device_dtype: str = SPACE
    shape: Any = SPACE
    metrics: dict[str, float] = field(default_factory=dict)

    def detail_row(self, precision: int = 14) -> list[Any]:
        """The values of `DETAIL_COLUMNS`, floats with `precision` decimals as the predecessor writes."""
        values = [self.metrics.get(name, SPACE) for name in _METRICS]
        values = [f"{v:.{precision}f}" if isinstance(v, float) else v for v in values]
        return [self.bench_dtype, self.device_dtype, self.shape, *values, self.status, self.message]


def worst(statuses: list[str]) -> str:
    """The overall status of several outputs (error > warning > pass); SPACE when none."""
    return max(statuses, key=_RANK.__getitem__, default=SPACE)


def dtype_key(dtype: str) -> str:
    """``torch.float16`` -> ``float16``."""
    return dtype.rsplit(".", 1)[-1]


def check_output(bench: np.ndarray, device: np.ndarray, dtype: str, bench_dtype: str = "torch.float64") -> OutputCheck:
    """Judge `device` (the run on the original dtype `dtype`, given as a float64 or integer array)
    against `bench` (the float64 benchmark) by the standard in the module docstring."""
    shape = tuple(device.shape)
    check = OutputCheck(PASS, bench_dtype=bench_dtype, device_dtype=dtype, shape=shape)
    if bench.shape != device.shape:
        check.status, check.message = ERROR, f"shape of bench {tuple(bench.shape)} and device {shape} differ"
        return check
    if bench.size == 0:
        check.status, check.message = SKIP, "empty output: nothing to compare"
        return check
    key = dtype_key(dtype)
    if key not in EPS:
        rate = float(np.mean(bench != device))
        check.metrics["error_rate"] = rate
        check.status = PASS if rate == 0 else ERROR
        check.message = f"{key} output: only exact (binary) comparison."
        return check
    return _check_float(bench.astype(np.float64), device.astype(np.float64), key, check)


def _check_float(bench: np.ndarray, device: np.ndarray, key: str, check: OutputCheck) -> OutputCheck:
    m = check.metrics
    bench_finite, device_finite = np.isfinite(bench), np.isfinite(device)
    mismatch = (bench_finite != device_finite) | (~bench_finite & ~device_finite & (bench != device)
                                                  & ~(np.isnan(bench) & np.isnan(device)))
    nonfinite = ~(bench_finite & device_finite)
    m["inf_nan_error_ratio"] = float(mismatch.sum() / nonfinite.sum()) if nonfinite.any() else 0.0
    finite = bench_finite & device_finite
    b, d = bench[finite], device[finite]
    abs_err = np.abs(d - b)
    rel_err = abs_err / (np.abs(b) + EPS[key])
    _measure(b, d, abs_err, rel_err, key, m)
    if mismatch.any():
        return _verdict(check, ERROR, f"inf/nan at {int(mismatch.sum())} element(s) where the benchmark differs.")
    if b.size == 0:
        return _verdict(check, PASS, "all values inf/nan, as in the benchmark.")
    cosine = _cosine(b, d)
    if cosine is not None:
        m["cosine_sim"] = cosine
        if cosine <= COSINE_MIN:
            return _verdict(check, ERROR, f"cosine similarity {cosine:.6f} is not above {COSINE_MIN}.")
    m["max_abs_err"] = float(abs_err.max())
    if m["max_abs_err"] < MAX_ABS_PASS:
        return _verdict(check, PASS, f"max abs error under {MAX_ABS_PASS}.")
    for threshold, status in RATIO_RULES[key in LOW_PRECISION]:
        share = float(np.mean(rel_err < threshold))
        m[RATIO_COLUMNS[threshold]] = share
        if share <= 1 - threshold:
            return _verdict(check, status, f"more than {threshold:.2%} of elements have a relative error "
                                           f"above {threshold:g}.")
    return _verdict(check, PASS, f"relative error within {threshold:g}.")


def _verdict(check: OutputCheck, status: str, message: str) -> OutputCheck:
    check.status, check.message = status, message
    return check


def _cosine(b: np.ndarray, d: np.ndarray) -> float | None:
    """Cosine similarity; None for a single value or two outputs of rounding noise around zero
    (softmax's gradient under a constant upstream gradient: exactly 0 in exact arithmetic)."""
    if b.size == 1 or (np.abs(b).max() <= NOISE and np.abs(d).max() <= NOISE):
        return None
    nb, nd = np.linalg.norm(b), np.linalg.norm(d)
    if nb == 0 and nd == 0:
        return None
    if nb == 0 or nd == 0:
        return 0.0
    return float(np.clip(np.dot(b / nb, d / nd), -1.0, 1.0))


def _measure(b: np.ndarray, d: np.ndarray, abs_err: np.ndarray, rel_err: np.ndarray, key: str,
             m: dict[str, float]) -> None:
    """The report-only columns of the newer standards (on the finite elements)."""
    if b.size == 0:
        return
    small, atol = SMALL_VALUE.get(key, SMALL_VALUE["float32"])
    small_mask = np.abs(b) <= small
    normal_rel = rel_err[~small_mask]
    m["eb"] = float(abs(np.sum(d > b) - np.sum(d < b)) / b.size)
    m["rmse"] = float(np.sqrt(np.mean(np.square(abs_err))))
    m["small_value_err_ratio"] = float(np.mean(abs_err[small_mask] > atol)) if small_mask.any() else 0.0
    m["max_rel_error"] = float(normal_rel.max()) if normal_rel.size else 0.0
    m["mean_rel_error"] = float(normal_rel.mean()) if normal_rel.size else 0.0
    if key in ULP:
        min_exp, mantissa = ULP[key]
        exponent = np.maximum(np.where(b == 0, min_exp, np.floor(np.log2(np.abs(b), where=b != 0,
                                                                               out=np.zeros_like(b)))), min_exp)
        ulp = np.abs(d - b) * np.exp2(mantissa - exponent)
        m["max_ulp_error"], m["mean_ulp_error"] = float(ulp.max()), float(ulp.mean())
        m["ulp_error_proportion"] = float(np.mean(ulp > (32 if key == "float32" else 1)))
