"""Output of the analysis verbs: streaming CSV/xlsx rows and readable text tables."""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from msprobe_engine.analysis.compare import COLUMNS, Comparison, Row
from msprobe_engine.analysis.overflow import RankAnalysis
from msprobe_engine.analysis.runs import RunComparison


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, list):
        return str(value)
    return value


def _xlsx_cell(value: Any) -> Any:
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


class RowWriter:
    """Writes compare rows to a CSV file and, optionally, an xlsx file, one row at a time."""

    def __init__(self, csv_path: Path | str | None, xlsx_path: Path | str | None = None) -> None:
        self._csv_file = self._csv = self._book = self._sheet = None
        self._xlsx_path = xlsx_path
        if xlsx_path is not None:
            try:
                from openpyxl import Workbook
            except ImportError:
                raise RuntimeError("xlsx output needs openpyxl: pip install openpyxl (or use the CSV output)") from None
            self._book = Workbook(write_only=True)
            self._sheet = self._book.create_sheet("compare")
            self._sheet.append(COLUMNS)
        if csv_path is not None:
            self._csv_file = open(csv_path, "w", newline="", encoding="utf-8")
            self._csv = csv.writer(self._csv_file)
            self._csv.writerow(COLUMNS)

    def write(self, row: Row) -> None:
        cells = [_cell(row.get(c)) for c in COLUMNS]
        if self._csv is not None:
            self._csv.writerow(cells)
        if self._sheet is not None:
            self._sheet.append([_xlsx_cell(c) for c in cells])

    def close(self) -> None:
        if self._csv_file is not None:
            self._csv_file.close()
        if self._book is not None:
            self._book.save(self._xlsx_path)

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _where(step: int | None, rank: int | None, path: str) -> str:
    return f"step {'-' if step is None else step} rank {'-' if rank is None else rank} ({path})"


def format_analysis(results: list[RankAnalysis]) -> str:
    """The findings of ``analyze`` as text: first critical entry on top, then execution order."""
    parts = []
    for res in results:
        first = res.first_critical
        head = f"{_where(res.step, res.rank, res.path)}: {res.entries} entries, {len(res.findings)} anomalous"
        lines = [head, f"first critical: {first.entry if first else 'none'}"]
        if res.findings:
            lines.append(_table(["order", "level", "scene", "entry", "anomalous tensors"],
                                [[f.order, f.level, f.scene, f.entry,
                                  ", ".join(f.bad_inputs + f.bad_outputs) or f.detail] for f in res.findings]))
        lines += [f"ignored: {i}" for i in res.ignored] + [f"problem: {p}" for p in res.problems]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def format_comparison(comp: Comparison) -> str:
    """A summary of ``compare``: counts, first failing entry and what stayed unmatched."""
    lines = []
    for r in comp.ranks:
        counts = ", ".join(f"{k} {r.counts[k]}" for k in ("pass", "warning", "error", "unmatched") if r.counts[k])
        lines.append(f"{_where(r.step, r.rank, r.a)} vs {r.b}: {r.mode} compare, {counts or 'no tensors'}")
        if r.first_error:
            e = r.first_error
            lines.append(f"  first error: {e['entry_a'] or e['entry_b']} {e['tensor']}: {e['reason']}")
        if r.first_warning:
            w = r.first_warning
            lines.append(f"  first warning: {w['entry_a'] or w['entry_b']} {w['tensor']}: {w['reason']}")
        if r.order_fallback:
            passes = ", ".join(f"{k} {n}" for k, n in r.matched_by.items() if n and not k.startswith("only"))
            lines.append(f"  names differ: entries matched by {passes}")
        lines += [f"  only in A: {n}" for n in r.only_a] + [f"  only in B: {n}" for n in r.only_b]
        lines += [f"  problem: {p}" for p in r.problems]
    lines += [f"problem: {p}" for p in comp.problems]
    return "\n".join(lines)


def format_runs(result: RunComparison) -> str:
    """A summary of a monitor-run comparison."""
    lines = [f"{result.steps_compared} step record(s) compared"]
    if result.first is None:
        lines.append("no divergence beyond the tolerance")
    else:
        f = result.first
        lines.append(f"first divergence: step {f.step} rank {f.rank} tag {f.tag}: A={f.a!r} B={f.b!r} "
                     f"(relative difference {f.rel_diff:.4g})")
        lines.append(_table(["step", "rank", "first diverging tag", "A", "B", "rel diff"],
                            [[d.step, d.rank, d.tag, repr(d.a), repr(d.b), f"{d.rel_diff:.4g}"]
                             for d in result.per_step]))
    lines += [f"only in A: {x}" for x in result.only_a] + [f"only in B: {x}" for x in result.only_b]
    lines += [f"problem: {p}" for p in result.problems]
    return "\n".join(lines)
