"""overflow_check for PyTorch: of each step, the calls whose outputs hold nan/inf are written.

The step's statistics (one host transfer) say which calls produced nan/inf; the first
``overflow_nums`` of them in execution order are written with their tensors (see
`held.HeldTensorsRecorder` for the cost), plus ``overflow_summary.json`` naming the first.
A clean step writes nothing.
"""
from __future__ import annotations

from typing import Any

from msprobe_engine.dump.step_filter import OVERFLOW_SUMMARY_JSON, overflow_summary, overflowing
from msprobe_engine.dump.writer import StepData
from msprobe_engine.frameworks.torch.capture.held import HeldTensorsRecorder

#: the step's summary: which calls overflowed, the first one first
SUMMARY_JSON = OVERFLOW_SUMMARY_JSON


class OverflowRecorder(HeldTensorsRecorder):
    """The dump's recorder for ``task: overflow_check``; `overflows` lists (step, first call) so far."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.overflows: list[tuple[int, str]] = []

    @property
    def results(self) -> list:
        return self.overflows

    def choose(self, step: int, data: StepData, held: list) -> tuple[list[str], dict[str, Any] | None]:
        limit = self.config.options.overflow_nums
        names = overflowing(data.entries, data.host_rows, limit)
        if not names:
            return names, None
        self.overflows.append((step, names[0]))
        return names, overflow_summary(step, names, limit)
