"""grad_probe's recorder, framework-neutral part: which optimizer steps are probed, the error
policy, the hand-over to the writer thread. A framework's recorder hooks the optimizer step
and measures (PyTorch: `frameworks.torch.grad_probe`, MindSpore: `frameworks.mindspore.grad_probe`)."""
from __future__ import annotations

from functools import partial
from typing import Callable


from msprobe_engine.dump.grad_probe_files import GradRows, write_grad_step
from msprobe_engine.dump.recorder import DumpRecorder, RecorderContext
from msprobe_engine.dump.writer import StepData
from msprobe_engine.stats import empty_rows


class GradProbeRecorder(DumpRecorder):
    """The grad_probe task's recorder (the session's `_recorder`); `remove()` takes its hooks off.
    `active` is set by the session; gradients are probed at every optimizer step regardless."""

    watches_model = True
    records_calls = False  # it reads gradients at the optimizer step

    def __init__(self, ctx: RecorderContext) -> None:
        super().__init__(ctx)
        self.rank, self.writer = ctx.rank, ctx.writer
        self.steps_written = 0
        self._step = 0

    def finish_step(self) -> StepData:
        """The session's step end: grad_probe writes at optimizer steps, nothing here."""
        return StepData({}, {}, None, empty_rows(), write_empty=False)

    def _next_step(self) -> int | None:
        """Count an optimizer step: its number when this step and rank are probed, else None."""
        step, self._step = self._step, self._step + 1
        wanted = self.config.wants_step(step) and self.config.wants_rank(self.rank or 0)
        return step if wanted else None

    def _probe(self, step: int, measure: Callable[[], GradRows | None]) -> None:
        """Measure on the training thread (an error is skipped once-logged, strict: raised);
        the files are written by the writer thread."""
        try:
            rows = measure()
        except Exception as exc:
            if not self.skipped("grad_probe", exc, f"msprobe grad_probe: step {step} not probed", " (reported once)"):
                raise
            return
        if rows is not None:
            self.writer.submit(partial(self._write, step, rows), "grad_probe step", wait=True)

    def _write(self, step: int, rows: GradRows) -> None:
        write_grad_step(self.config.dump_path, self.rank, step, self.options.grad_level, self.options.bounds, rows)
        self.steps_written += 1
