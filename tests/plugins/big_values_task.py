"""A user's dump task: of each step, only the calls with a tensor whose largest magnitude
exceeds `threshold` (read from the statistics the step already transfers), on PyTorch."""
from dataclasses import dataclass, field

import numpy as np

from msprobe_engine.fields import at_least
from msprobe_engine.dump.recorder import register_recorder
from msprobe_engine.dump.step_filter import iter_slots, keep_entries
from msprobe_engine.dump.task import DumpTask, FullSelection, register_task
from msprobe_engine.dump.writer import StepData
from msprobe_engine.frameworks.torch.capture.recorder import Recorder
from msprobe_engine.stats import P_MAX, P_MIN


@register_task("big_values")
class BigValues(DumpTask):
    levels = ("L0", "L1", "mix")

    @dataclass(kw_only=True, slots=True)
    class Config(FullSelection):
        threshold: float = field(default=1e3, metadata=at_least(0.0))


class BigValuesRecorder(Recorder):
    """Records as the statistics dump, then keeps the calls holding a big value."""

    def finish_step(self) -> StepData:
        data = super().finish_step()
        rows = np.asarray(data.host_rows, dtype=np.float64)
        if not len(rows):
            return keep_entries(data, [])
        largest = np.maximum(np.abs(rows[:, P_MAX]), np.abs(rows[:, P_MIN]))
        big = [name for name, skeleton in data.entries.items()
               if any(0 <= s.row < len(rows) and largest[s.row] > self.options.threshold for s in iter_slots(skeleton))]
        return keep_entries(data, big)


register_recorder("pytorch", "big_values", BigValuesRecorder)
