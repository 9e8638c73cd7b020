"""``api_precision_compare``: two pre-check runs' details compared, as the predecessor's tool does.

The pre-check (`run_ut`) judges one device against a float64 benchmark. When a second device
is the reference (the predecessor's NPU against GPU), each device's ``accuracy_checking_details``
CSV is compared row by row: for a floating output (float16, bfloat16, float32) the ratio of
the device's error metric to the reference device's, ``|device| / max(|reference|, floor)``
(floor 2^-11 for float16, 2^-8 for bfloat16, 2^-14 else), is an ``error`` above its threshold:
small-value error share 2, error balance 2 (reported, not judged), RMSE / mean relative error /
max relative error 2 / 2 / 10 (1.5 / 1.5 / 5 for the APIs of `LEVEL1_APIS`, 1.2 / 1.2 / 2 for
`LEVEL2_APIS`); an inf/nan on one side only is an ``error``. Integer and bool outputs: the
device's binary error rate must be 0. Outputs whose input was float8 (a filled 相对误差错误率):
the absolute-threshold rates must all be 0. float64 and complex outputs, blank dtypes and empty
shapes are ``SKIP``; float8 outputs (the predecessor's ULP standard) are ``SKIP`` here.

Written, in the predecessor's layout (UTF-8 with BOM, floats with 14 decimals):
``api_precision_compare_result_<time>.csv`` (``API Name, Forward Test Success, Backward Test
Success, Message``, one row per API call) and ``api_precision_compare_details_<time>.csv``
(`DETAIL_COLUMNS`, one row per output). A row of the device whose name the reference lacks is
left out, as there.
"""
from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path
from typing import Any

from msprobe_engine.analysis.precheck.standards import ERROR, PASS, SKIP, SPACE, WARNING, worst

RESULT_PREFIX, DETAILS_PREFIX = "api_precision_compare_result_", "api_precision_compare_details_"
#: the columns both inputs must have
REQUIRED = ("API Name", "DEVICE Dtype", "小值域错误占比", "均方根误差", "相对误差最大值", "相对误差平均值",
            "误差均衡性", "二进制一致错误率", "inf/nan错误率", "相对误差错误率", "绝对误差错误率", "ULP误差平均值",
            "ULP误差大于阈值占比", "双千指标")
RESULT_COLUMNS = ("API Name", "Forward Test Success", "Backward Test Success", "Message")
#: the details row: one field of `_Row` each, in order
DETAIL_COLUMNS = ("API Name", "小值域错误比值", "小值域判定结果", "均方根误差比值", "均方根误差判定结果",
                  "相对误差最大值比值", "相对误差最大值判定结果", "相对误差平均值比值", "相对误差平均值判定结果",
                  "误差均衡性比值", "误差均衡性判定结果", "inf/nan错误率", "inf/nan判定结果", "相对误差错误率",
                  "相对误差判定结果", "绝对误差错误率", "绝对误差判定结果", "二进制一致错误率", "二进制一致错误率判定结果",
                  "ULP误差平均值", "ULP误差大于阈值占比", "ULP误差大于阈值占比比值", "ULP误差判定结果", "双千指标",
                  "双千指标判定结果", "比对结果", "比对算法", "Message")
UNSUPPORTED = ("torch.float64", "torch.complex64", "torch.complex128")
FLOATS = ("torch.float16", "torch.bfloat16", "torch.float32")
FLOOR = {"torch.float16": 2.0 ** -11, "torch.bfloat16": 2.0 ** -8}
DEFAULT_FLOOR = 2.0 ** -14
LEVEL1_APIS = frozenset({"embedding", "npu_fusion_attention_grad", "npu_fusion_attention", "scatter_", "scatter_add_"})
LEVEL2_APIS = frozenset({"addmm", "npu_cross_entropy_loss", "npu_cross_entropy_loss_backward", "GELU", "layer_norm",
                         "matmul", "mm", "index", "one_hot", "sum", "npu_rms_norm", "npu_rms_norm_backward", "nonzero"})
#: (rmse, mean relative error, max relative error) thresholds by API level
LEVEL_THRESHOLDS = {0: (2.0, 2.0, 10.0), 1: (1.5, 1.5, 5.0), 2: (1.2, 1.2, 2.0)}
SMALL_VALUE_THRESHOLD = EB_THRESHOLD = 2.0
#: (detail field prefix, input column, message when it is an error); the last is reported, not judged
BENCHMARK = (("small_value_err", "小值域错误占比", "小值域错误比值超过阈值"),
             ("rmse", "均方根误差", "均方根误差比值超过阈值"),
             ("max_rel_err", "相对误差最大值", "相对误差最大值比值超过阈值"),
             ("mean_rel_err", "相对误差平均值", "相对误差平均值比值超过阈值"),
             ("eb", "误差均衡性", ""))
ABSOLUTE = (("inf_nan_error_ratio", "inf/nan错误率", "inf/nan错误率超过阈值"),
            ("rel_err_ratio", "相对误差错误率", "相对误差错误率超过阈值"),
            ("abs_err_ratio", "绝对误差错误率", "绝对误差错误率超过阈值"))
UNSUPPORTED_MESSAGE = "This data type does not support benchmark compare."
#: what the predecessor adds to an API's error message
API_HINTS = {"topk": "在npu上，topk的入参sorted=False时不生效，会返回有序tensor，而cpu上会返回无序tensor。 "
                     "如果topk精度不达标，请检查是否是该原因导致的。"}
_FIELDS = ("api_name", "small_value_err_ratio", "small_value_err_status", "rmse_ratio", "rmse_status",
           "max_rel_err_ratio", "max_rel_err_status", "mean_rel_err_ratio", "mean_rel_err_status", "eb_ratio",
           "eb_status", "inf_nan_error_ratio", "inf_nan_error_ratio_status", "rel_err_ratio", "rel_err_ratio_status",
           "abs_err_ratio", "abs_err_ratio_status", "error_rate", "error_rate_status", "mean_ulp_err",
           "ulp_err_proportion", "ulp_err_proportion_ratio", "ulp_err_status", "rel_err_thousandth",
           "rel_err_thousandth_status", "compare_result", "compare_algorithm", "compare_message")


def read_details(path: Path) -> list[dict[str, str]]:
    """The rows of a pre-check details CSV; a missing column is one `ValueError` naming it."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    header = list(rows[0]) if rows else []
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise ValueError(f"{path}: not a pre-check details file: missing column(s) {', '.join(missing)}")
    return rows


def compare_details(device: list[dict[str, str]], reference: list[dict[str, str]]
                    ) -> tuple[list[list[Any]], list[list[Any]]]:
    """(result rows, details rows) of `device` judged against `reference` (module docstring)."""
    by_name: dict[str, list[dict[str, str]]] = {}
    for row in reference:
        by_name.setdefault(row["API Name"], []).append(row)
    results: list[list[Any]] = []
    details: list[list[Any]] = []
    api = _Api()
    for row in device:
        name = row["API Name"]
        parsed = _split(name)
        if parsed is None:
            message = f"The API name {name} is invalid."
            details.append(_Row(name, compare_result=SKIP, compare_message=message).values())
            results.append([name, SKIP, SKIP, message])
            continue
        api_name, full_name, direction = parsed
        matches = by_name.get(name, [])
        if not matches:
            continue
        if len(matches) > 1:
            raise ValueError(f"{name}: {len(matches)} rows in the reference's details")
        out = _Row(name)
        try:
            status = _judge(row, matches[0], api_name, out)
        except ValueError as exc:
            details.append(_Row(name, compare_result=SKIP, compare_message=str(exc)).values())
            results.append([name, SKIP, SKIP, str(exc)])
            continue
        details.append(out.values())
        if api.name is not None and full_name != api.name:
            results.append(api.result())
            api = _Api()
        api.name, api.dtype = full_name, row["DEVICE Dtype"]
        if api.dtype in UNSUPPORTED:
            continue
        if direction == "forward":
            api.forward.append(status)
            api.skip_message = row["Message"] if status == SKIP else ""
        elif direction == "backward":
            api.backward.append(status)
    if api.name is not None:
        results.append(api.result())
    return results, details


def api_precision_compare(device_csv: Path, reference_csv: Path, out_dir: Path) -> tuple[Path, Path]:
    """Compare the two details files; (the result CSV, the details CSV) written in `out_dir`."""
    results, details = compare_details(read_details(Path(device_csv)), read_details(Path(reference_csv)))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d%H%M%S")
    paths = out_dir / f"{RESULT_PREFIX}{stamp}.csv", out_dir / f"{DETAILS_PREFIX}{stamp}.csv"
    for path, header, rows in ((paths[0], RESULT_COLUMNS, results), (paths[1], DETAIL_COLUMNS, details)):
        with open(path, "w", newline="", encoding="utf-8-sig") as f:
            csv.writer(f).writerows([header, *rows])
    return paths


# ---- the command line (``msprobe-engine api-precision-compare``) --------------------------------
def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-npu", "--npu_csv_path", required=True, metavar="CSV",
                   help="accuracy_checking_details_<time>.csv of the device under test")
    p.add_argument("-gpu", "--gpu_csv_path", required=True, metavar="CSV",
                   help="accuracy_checking_details_<time>.csv of the reference device")
    p.add_argument("-o", "--out_path", default=".", metavar="DIR", help="where the two CSVs go (default: .)")


def run(args: argparse.Namespace) -> int:
    """Write the two CSVs; exit 0 when no API is an error, 1 when one is."""
    result, details = api_precision_compare(Path(args.npu_csv_path), Path(args.gpu_csv_path), Path(args.out_path))
    with open(result, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f))[1:]
    errors = [r[0] for r in rows if ERROR in (r[1], r[2])]
    print(f"{len(rows)} API(s) compared, {len(errors)} error(s){': ' + ', '.join(errors[:10]) if errors else ''}")
    print(f"written: {result}\n         {details}")
    return 1 if errors else 0


# ---- one output ---------------------------------------------------------------------------------
class _Row:
    """One details row (the predecessor's fields, blank until set)."""

    def __init__(self, api_name: str, **values: Any) -> None:
        self.__dict__.update(dict.fromkeys(_FIELDS, SPACE), api_name=api_name, **values)

    def values(self) -> list[Any]:
        return [f"{v:.14f}" if isinstance(v, float) else v for v in (getattr(self, k) for k in _FIELDS)]


class _Api:
    """The statuses of one API call's outputs, until the next call's rows begin."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.dtype = ""
        self.forward: list[str] = []
        self.backward: list[str] = []
        self.skip_message = ""

    def result(self) -> list[Any]:
        if self.dtype in UNSUPPORTED:
            return [self.name, SKIP, SKIP, UNSUPPORTED_MESSAGE]
        forward, backward = _overall(self.forward), _overall(self.backward)
        message = API_HINTS.get(_base_name(self.name), "") if forward == ERROR else ""
        message += self.skip_message if forward == SKIP else ""
        return [self.name, forward, backward, message]


def _overall(statuses: list[str]) -> str:
    if not statuses:
        return SPACE
    if all(s == SKIP for s in statuses):
        return SKIP
    return worst([s for s in statuses if s != SKIP])


def _judge(device: dict[str, str], reference: dict[str, str], api_name: str, out: _Row) -> str:
    dtype = device["DEVICE Dtype"]
    if dtype.isspace() or not dtype or dtype in UNSUPPORTED or device["Shape"] == "(0,)":
        out.compare_result, out.compare_message = SKIP, device["Message"]
        return SKIP
    if "float8" in dtype:
        out.compare_result = SKIP
        out.compare_message = f"{dtype} output: the ULP standard is not implemented here"
        return SKIP
    if not device["相对误差错误率"].isspace() and device["相对误差错误率"]:
        return _absolute(device, out)
    if dtype in FLOATS:
        return _benchmark(device, reference, dtype, api_name, out)
    return _binary(device, out)


def _benchmark(device: dict[str, str], reference: dict[str, str], dtype: str, api_name: str, out: _Row) -> str:
    level = 2 if api_name in LEVEL2_APIS else 1 if api_name in LEVEL1_APIS else 0
    rmse, mean_rel, max_rel = LEVEL_THRESHOLDS[level]
    thresholds = {"small_value_err": SMALL_VALUE_THRESHOLD, "rmse": rmse, "max_rel_err": max_rel,
                  "mean_rel_err": mean_rel, "eb": EB_THRESHOLD}
    notes, errors = "", ""
    for field, column, message in BENCHMARK:
        ours, theirs = _number(device[column]), _number(reference[column])
        consistent = True
        if _nonfinite(ours) or _nonfinite(theirs):
            ratio = math.nan
            consistent = (math.isinf(ours) and math.isinf(theirs) and ours == theirs) or \
                (math.isnan(ours) and math.isnan(theirs))
            notes += f"{column}{'同为同号inf或nan' if consistent else 'inf或nan不一致'}\n"
        else:
            ratio = abs(ours) / max(abs(theirs), FLOOR.get(dtype, DEFAULT_FLOOR))
        status = ERROR if not consistent or (not math.isnan(ratio) and ratio > thresholds[field]) else PASS
        setattr(out, f"{field}_ratio", ratio)
        setattr(out, f"{field}_status", status)
        if status == ERROR and message:
            errors += f"ERROR: {message}\n"
    judged = [getattr(out, f"{field}_status") for field, _, message in BENCHMARK if message]
    out.compare_result = ERROR if ERROR in judged else WARNING if WARNING in judged else PASS
    out.compare_algorithm, out.compare_message = "标杆比对法", notes + errors
    return out.compare_result


def _binary(device: dict[str, str], out: _Row) -> str:
    out.error_rate = device["二进制一致错误率"]
    out.error_rate_status = out.compare_result = PASS if _number(out.error_rate, strict=True) == 0 else ERROR
    out.compare_algorithm = "二进制一致法"
    out.compare_message = "ERROR: 二进制一致错误率超过阈值\n" if out.compare_result == ERROR else ""
    return out.compare_result


def _absolute(device: dict[str, str], out: _Row) -> str:
    message = ""
    for field, column, text in ABSOLUTE:
        value = _number(device[column], strict=True)
        setattr(out, field, value)
        setattr(out, f"{field}_status", PASS if value == 0 else ERROR)
        message += f"ERROR: {text}" if value != 0 else ""
    out.compare_result = ERROR if message else PASS
    out.compare_algorithm, out.compare_message = "绝对阈值法", message
    return out.compare_result


def _number(text: str, strict: bool = False) -> float:
    """A details cell as a number: blank is 0 (nan when empty), unless `strict` (then an error)."""
    if not text.strip():
        if strict:
            raise ValueError("ERROR: Input data is an empty string")
        return math.nan if text == "" else 0.0
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"ERROR: Input data cannot be converted to float: {text!r}") from None


def _nonfinite(x: float) -> bool:
    return math.isnan(x) or math.isinf(x)


def _split(name: str) -> tuple[str, str, str] | None:
    """(API name, API call, direction) of ``Type.name.n.forward.output.i`` (or ``Type.ns.name....``)."""
    parts = name.split(".")
    if len(parts) == 6:
        return parts[1], ".".join(parts[:3]), parts[3]
    if len(parts) == 7:
        return ".".join(parts[1:3]), ".".join(parts[:4]), parts[4]
    return None


def _base_name(call: str | None) -> str:
    parts = (call or "").split(".")
    return parts[1] if len(parts) == 3 else ".".join(parts[1:3]) if len(parts) == 4 else ""
