"""`mean`: the sum over the element count (nan when empty)."""
import numpy as np

from msprobe_engine.stats.registry import Statistic, register_statistic


@register_statistic("mean")
class Mean(Statistic):
    needs = ("sum", "numel")

    def compute(self, p: dict[str, np.ndarray]) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return p["sum"] / np.where(p["numel"] == 0, np.nan, p["numel"])
