"""The pre-check's result files, in the predecessor's layout, appended one API at a time:

- ``accuracy_checking_result_<time>.csv``: ``API name, Forward Test Success, Backward Test Success,
  Message`` (one row per API call; ``pass``/``warning``/``error``/``SKIP``; a blank backward
  status where the call has no backward);
- ``accuracy_checking_details_<time>.csv``: ``API Name`` plus `standards.DETAIL_COLUMNS`, one
  row per output (``<API>.forward.output.<i>``) and input gradient (``<API>.backward.output.<i>``).

Rows are flushed as they are written, so an interrupted run leaves every finished API on disk;
`PrecheckReport(resume=True)` reopens the newest pair in the directory and skips those APIs.
"""
from __future__ import annotations

import csv
import io
import time
from dataclasses import dataclass, field
from pathlib import Path

from msprobe_engine.analysis.precheck.standards import DETAIL_COLUMNS, SKIP, SPACE, OutputCheck, worst
from msprobe_engine.errors import read_utf8

RESULT_PREFIX, DETAILS_PREFIX = "accuracy_checking_result_", "accuracy_checking_details_"
RESULT_COLUMNS = ("API name", "Forward Test Success", "Backward Test Success", "Message")


@dataclass
class ApiResult:
    """The verdicts of one API call."""
    name: str
    forward: list[OutputCheck] = field(default_factory=list)
    backward: list[OutputCheck] = field(default_factory=list)
    forward_skip: str | None = None
    backward_skip: str | None = None

    @property
    def forward_status(self) -> str:
        return SKIP if self.forward_skip else worst([c.status for c in self.forward])

    @property
    def backward_status(self) -> str:
        if self.forward_skip:
            return SPACE
        return SKIP if self.backward_skip else worst([c.status for c in self.backward])

    @property
    def message(self) -> str:
        return self.forward_skip or self.backward_skip or ""

    def summary_row(self) -> list[str]:
        return [self.name, self.forward_status, self.backward_status, self.message]

    def detail_rows(self, precision: int = 14) -> list[list]:
        rows = [[f"{self.name}.forward.output.{i}", *c.detail_row(precision)] for i, c in enumerate(self.forward)]
        rows += [[f"{self.name}.backward.output.{i}", *c.detail_row(precision)] for i, c in enumerate(self.backward)]
        return rows


class PrecheckReport:
    """The result and details CSVs of one pre-check run in `out_dir` (see the module docstring)."""

    def __init__(self, out_dir: Path | str, resume: bool = False, precision: int = 14) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.precision = precision
        self.done: set[str] = set()
        self.counts: dict[str, int] = {}
        previous = sorted(self.out_dir.glob(f"{RESULT_PREFIX}*.csv")) if resume else []
        if previous:
            self.result_path = previous[-1]
            self.details_path = self.result_path.with_name(self.result_path.name.replace(RESULT_PREFIX, DETAILS_PREFIX))
            rows = csv.reader(io.StringIO(read_utf8(self.result_path), newline=""))
            self.done = {row[0] for row in list(rows)[1:] if row}
        else:
            stamp = time.strftime("%Y%m%d%H%M%S")
            self.result_path = self.out_dir / f"{RESULT_PREFIX}{stamp}.csv"
            self.details_path = self.out_dir / f"{DETAILS_PREFIX}{stamp}.csv"
        self._result_file = open(self.result_path, "a", newline="", encoding="utf-8")
        self._details_file = open(self.details_path, "a", newline="", encoding="utf-8")
        self._result, self._details = csv.writer(self._result_file), csv.writer(self._details_file)
        if not self.done:
            if self._result_file.tell() == 0:
                self._result.writerow(RESULT_COLUMNS)
            if self._details_file.tell() == 0:
                self._details.writerow(("API Name", *DETAIL_COLUMNS))

    def add(self, result: ApiResult) -> None:
        """Append one API's rows (flushed at once)."""
        self._details.writerows(result.detail_rows(self.precision))
        self._details_file.flush()
        self._result.writerow(result.summary_row())
        self._result_file.flush()
        self.done.add(result.name)
        for status in (result.forward_status, result.backward_status):
            if status != SPACE:
                self.counts[status] = self.counts.get(status, 0) + 1

    def close(self, xlsx: Path | str | None = None) -> None:
        """Close the files; with `xlsx`, also write both tables as sheets of one workbook."""
        self._result_file.close()
        self._details_file.close()
        if xlsx is not None:
            write_xlsx(xlsx, {"result": self.result_path, "details": self.details_path})


def write_xlsx(path: Path | str, sheets: dict[str, Path]) -> None:
    """CSV files as the sheets of one xlsx workbook (needs openpyxl)."""
    try:
        from openpyxl import Workbook
    except ImportError:
        raise RuntimeError("xlsx output needs openpyxl: pip install openpyxl (or use the CSV output)") from None
    book = Workbook(write_only=True)
    for title, csv_path in sheets.items():
        sheet = book.create_sheet(title)
        with open(csv_path, newline="", encoding="utf-8") as f:
            for row in csv.reader(f):
                sheet.append(row)
    book.save(path)
