"""`min`: the smallest value (nan when the tensor holds a nan; absent, nan, when empty)."""
import numpy as np

from msprobe_engine.stats.registry import Statistic, register_statistic


@register_statistic("min")
class Min(Statistic):
    needs = ("min", "numel")

    def compute(self, p: dict[str, np.ndarray]) -> np.ndarray:
        return np.where(p["numel"] == 0, np.nan, p["min"])
