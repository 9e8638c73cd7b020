"""`compare`: two dumps, entry by entry and tensor by tensor.

A is the baseline, B the target: differences are B - A, relative errors |B - A| / |A|.
Statistics dumps compare Max/Min/Mean/Norm; tensor dumps (task "tensor" on both sides)
also open each tensor pair (memory-mapped, ``RankDump.open_tensor``), one pair at a time, and
compute ``metrics.tensor_metrics`` over it chunk by chunk, so memory holds one pair plus fixed
work buffers, whatever the dump size.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from msprobe_engine.analysis.framework_map import canonical_label, canonical_names
from msprobe_engine.analysis.match import count_by_pass, match_entries
from msprobe_engine.analysis.metrics import nonfinite_disagree, stat_differences, tensor_metrics
from msprobe_engine.analysis.progress import Progress
from msprobe_engine.dump.reader import DumpError, RankDump, load_dump
from msprobe_engine.dump.schema import STAT_KEYS, TensorRef, iter_tensors

STATUSES = ("pass", "warning", "error", "unmatched")
METRIC_COLUMNS = ["cosine", "max_abs_err", "max_rel_err", "one_thousandth_ratio", "five_thousandth_ratio",
                  "euclidean_distance", "nonfinite_mismatch"]
COLUMNS = (["step", "rank", "order", "entry_a", "entry_b", "match", "tensor", "dtype_a", "dtype_b", "shape_a",
            "shape_b"]
           + [f"{k}_{side}" for side in "ab" for k in STAT_KEYS]
           + [f"{k}_{kind}" for k in STAT_KEYS for kind in ("diff", "rel_err")]
           + ["md5_a", "md5_b"] + METRIC_COLUMNS + ["status", "reason"])
Row = dict[str, Any]


@dataclass(kw_only=True, slots=True)
class Thresholds:
    """Limits that mark a row warning or error (see docs/analysis.md)."""
    cosine_error: float = 0.99
    cosine_warning: float = 0.9999
    thousandth_warning: float = 0.99
    stat_rel_error: float = 0.5
    stat_rel_warning: float = 0.01


@dataclass
class RankComparison:
    """Summary of one pair of rank directories."""
    a: str
    b: str
    step: int | None
    rank: int | None
    mode: str
    order_fallback: bool = False
    matched_by: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATUSES, 0))
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    repaired: list[tuple[str, str]] = field(default_factory=list)
    first_error: Row | None = None
    first_warning: Row | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class Comparison:
    """Result of ``compare_dumps``: one summary per rank pair, the rows if kept, and problems."""
    ranks: list[RankComparison]
    rows: list[Row] | None
    problems: list[str]

    @property
    def first_error(self) -> Row | None:
        return next((r.first_error for r in self.ranks if r.first_error), None)

    def summary(self) -> dict[str, Any]:
        """Everything but the rows, JSON-ready."""
        first = self.first_error
        return {"first_error": {k: first[k] for k in ("step", "rank", "entry_a", "entry_b", "tensor", "reason")}
                if first else None,
                "ranks": [asdict(r) for r in self.ranks], "problems": self.problems}


def _stats(ref: TensorRef | None) -> dict[str, float | None]:
    return {k: ref.stat(k) for k in STAT_KEYS} if ref else {}


def _base_row(step, rank, order, entry_a, entry_b, how, label, ref_a, ref_b) -> Row:
    row: Row = dict.fromkeys(COLUMNS)
    row.update(step=step, rank=rank, order=order, entry_a=entry_a, entry_b=entry_b, match=how, tensor=label)
    for side, ref in (("a", ref_a), ("b", ref_b)):
        if ref is None:
            continue
        row[f"dtype_{side}"] = ref.record.get("dtype")
        row[f"shape_{side}"] = ref.record.get("shape")
        row[f"md5_{side}"] = ref.record.get("md5")
        for k in STAT_KEYS:
            row[f"{k}_{side}"] = ref.stat(k)
    if ref_a is not None and ref_b is not None:
        row.update(stat_differences(_stats(ref_a), _stats(ref_b)))
    return row


def _judge(row: Row, th: Thresholds, tensor_mode: bool) -> tuple[str, str]:
    errors, warnings = [], []
    bad = [k for k in STAT_KEYS if nonfinite_disagree(row[f"{k}_a"], row[f"{k}_b"])]
    if bad:
        errors.append(f"nan/inf differ in {', '.join(bad)}")
    if row["shape_a"] != row["shape_b"]:
        errors.append(f"shape {row['shape_a']} vs {row['shape_b']}")
    if row["md5_a"] and row["md5_b"] and row["md5_a"] != row["md5_b"]:
        errors.append("md5 differs")
    if tensor_mode and row["cosine"] is not None:
        if row["nonfinite_mismatch"]:
            errors.append(f"{row['nonfinite_mismatch']} nan/inf positions differ")
        if row["cosine"] < th.cosine_error:
            errors.append(f"cosine {row['cosine']:.6g} < {th.cosine_error}")
        elif row["cosine"] < th.cosine_warning:
            warnings.append(f"cosine {row['cosine']:.6g} < {th.cosine_warning}")
        if row["one_thousandth_ratio"] < th.thousandth_warning:
            warnings.append(f"one-thousandth ratio {row['one_thousandth_ratio']:.4g} < {th.thousandth_warning}")
    elif not tensor_mode:
        for k in ("Max", "Min", "Norm"):
            rel = row[f"{k}_rel_err"]
            if rel is None or rel != rel:
                continue
            if rel > th.stat_rel_error:
                errors.append(f"{k} relative error {rel:.4g} > {th.stat_rel_error}")
            elif rel > th.stat_rel_warning:
                warnings.append(f"{k} relative error {rel:.4g} > {th.stat_rel_warning}")
    if errors:
        return "error", "; ".join(errors + warnings)
    return ("warning", "; ".join(warnings)) if warnings else ("pass", "")


@dataclass(slots=True)
class _Job:
    row: Row
    ref_a: TensorRef | None
    ref_b: TensorRef | None


def _load_pair(job: _Job, dump_a: RankDump, dump_b: RankDump, tensor_mode: bool):
    """The two tensors (torch tensors or numpy arrays) of a job, None when nothing is to be loaded,
    or an error message."""
    if not (tensor_mode and job.ref_a and job.ref_b) or job.row["shape_a"] != job.row["shape_b"]:
        return None
    try:
        arrays = []
        for dump, ref in ((dump_a, job.ref_a), (dump_b, job.ref_b)):
            array = dump.open_tensor(ref)
            if list(array.shape) != ref.record.get("shape"):
                raise DumpError(f"{dump.tensor_file(ref)}: shape {list(array.shape)} differs from "
                                f"dump.json shape {ref.record.get('shape')} (data[{ref.entry!r}].{ref.label})")
            arrays.append(array)
        return arrays
    except DumpError as e:
        return str(e)


def _names(dump: RankDump, other: RankDump) -> dict[str, str]:
    """Matching name -> entry name; names are in PyTorch's terms when the frameworks differ
    (`framework_map`), else the entry names themselves."""
    names = list(dump.data)
    if dump.framework == other.framework:
        return dict(zip(names, names))
    return dict(zip(canonical_names(names, dump.framework), names))


def _refs(dump: RankDump, entry: str | None, other: RankDump) -> dict[str, TensorRef]:
    if entry is None:
        return {}
    translate = dump.framework != other.framework
    return {canonical_label(r.label, dump.framework) if translate else r.label: r
            for r in iter_tensors(entry, dump.data[entry])}


def _jobs(summary: RankComparison, dump_a: RankDump, dump_b: RankDump, progress: Progress) -> Iterator[_Job]:
    names_a, names_b = _names(dump_a, dump_b), _names(dump_b, dump_a)
    pairs, summary.order_fallback = match_entries(
        list(names_a), list(names_b), {n: dump_a.data[e] for n, e in names_a.items()},
        {n: dump_b.data[e] for n, e in names_b.items()})
    summary.matched_by = count_by_pass(pairs)
    progress.start(len(pairs))
    for order, pair in enumerate(pairs):
        progress.update(order + 1)
        entry_a, entry_b = names_a.get(pair.a), names_b.get(pair.b)
        if pair.how == "only_a":
            summary.only_a.append(entry_a)
        elif pair.how == "only_b":
            summary.only_b.append(entry_b)
        elif pair.how != "name":
            summary.repaired.append((entry_a, entry_b))
        refs_a, refs_b = _refs(dump_a, entry_a, dump_b), _refs(dump_b, entry_b, dump_a)
        for label in [*refs_a, *(k for k in refs_b if k not in refs_a)]:
            row = _base_row(summary.step, summary.rank, order, entry_a, entry_b, pair.how, label,
                            refs_a.get(label), refs_b.get(label))
            yield _Job(row, refs_a.get(label), refs_b.get(label))
    progress.finish()


def _measure(job: _Job, dump_a: RankDump, dump_b: RankDump, tensor_mode: bool, th: Thresholds,
             problems: list[str]) -> None:
    """Fill the metrics (tensor mode), status and reason of a row; the arrays are freed on return."""
    row = job.row
    loaded = _load_pair(job, dump_a, dump_b, tensor_mode)
    if isinstance(loaded, str):
        problems.append(loaded)
        row["status"], row["reason"] = "error", loaded
        return
    if loaded is not None:
        row.update(tensor_metrics(*loaded).as_dict())
        del row["numel"]
    row["status"], row["reason"] = _judge(row, th, tensor_mode)


def _compare_rank(dump_a: RankDump, dump_b: RankDump, th: Thresholds, statistics_only: bool,
                  progress: Progress, on_row: Callable[[Row], None]) -> RankComparison:
    tensor_mode = not statistics_only and dump_a.task == "tensor" and dump_b.task == "tensor"
    summary = RankComparison(str(dump_a.path), str(dump_b.path), dump_a.step, dump_a.rank,
                             "tensor" if tensor_mode else "statistics",
                             problems=dump_a.problems + dump_b.problems)
    for job in _jobs(summary, dump_a, dump_b, progress):
        row = job.row
        if job.ref_a is None or job.ref_b is None:
            side = "A" if job.ref_b is None else "B"
            if row["entry_a"] is None or row["entry_b"] is None:
                row["status"], row["reason"] = "unmatched", f"entry only in {side}"
            else:
                row["status"], row["reason"] = "error", f"tensor only in {side}"
        else:
            _measure(job, dump_a, dump_b, tensor_mode, th, summary.problems)
        summary.counts[row["status"]] += 1
        if row["status"] == "error" and summary.first_error is None:
            summary.first_error = row
        if row["status"] == "warning" and summary.first_warning is None:
            summary.first_warning = row
        on_row(row)
    return summary


def compare_rank_dumps(dump_a: RankDump, dump_b: RankDump, thresholds: Thresholds | None = None, *,
                       statistics_only: bool = False) -> tuple[RankComparison, list[Row]]:
    """Compare two rank directories already loaded (``graph`` uses it): the summary and all rows."""
    rows: list[Row] = []
    summary = _compare_rank(dump_a, dump_b, thresholds or Thresholds(), statistics_only,
                            Progress("compare", enabled=False), rows.append)
    return summary, rows


def _pair_ranks(dumps_a: dict, dumps_b: dict) -> tuple[list[tuple[RankDump, RankDump]], list[str]]:
    if len(dumps_a) == 1 and len(dumps_b) == 1:
        return [(next(iter(dumps_a.values())), next(iter(dumps_b.values())))], []
    pairs = [(dumps_a[k], dumps_b[k]) for k in dumps_a if k in dumps_b]
    problems = [f"step {k[0]} rank {k[1]}: only in A ({dumps_a[k].path})" for k in dumps_a if k not in dumps_b]
    problems += [f"step {k[0]} rank {k[1]}: only in B ({dumps_b[k].path})" for k in dumps_b if k not in dumps_a]
    return pairs, problems


def compare_dumps(a: Path | str, b: Path | str, thresholds: Thresholds | None = None, *,
                  statistics_only: bool = False, on_row: Callable[[Row], None] | None = None,
                  keep_rows: bool = True, progress: bool | None = None) -> Comparison:
    """Compare dump ``b`` (target) with dump ``a`` (baseline); each may be a rank dir or a dump root.

    Rank directories pair by (step, rank) (a single rank dir on each side pairs as is).
    Every row goes to ``on_row`` as soon as it is computed (for streaming output) and is kept
    in ``Comparison.rows`` when ``keep_rows``. A missing or unreadable tensor becomes an
    error row naming the file and entry; the comparison goes on. ``progress``: True/False,
    or None for a stderr progress line only when stderr is a terminal.
    """
    th = thresholds or Thresholds()
    dumps_a, dumps_b = load_dump(a, strict=False), load_dump(b, strict=False)
    rank_pairs, problems = _pair_ranks(dumps_a, dumps_b)
    rows: list[Row] | None = [] if keep_rows else None

    def emit(row: Row) -> None:
        if rows is not None:
            rows.append(row)
        if on_row is not None:
            on_row(row)

    bar = Progress("compare", enabled=progress)
    ranks = [_compare_rank(da, db, th, statistics_only, bar, emit) for da, db in rank_pairs]
    return Comparison(ranks, rows, problems)

