"""`zero_frac`: the share of elements equal to zero (costs one more pass; nan when empty)."""
import numpy as np

from msprobe_engine.stats.registry import Statistic, register_statistic


@register_statistic("zero_frac")
class ZeroFrac(Statistic):
    needs = ("zero_count", "numel")

    def compute(self, p: dict[str, np.ndarray]) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return p["zero_count"] / np.where(p["numel"] == 0, np.nan, p["numel"])
