"""A user's statistic: the root mean square, from the partial columns the backends already take."""
import numpy as np

from msprobe_engine.stats import Statistic, register_statistic


@register_statistic("rms")
class Rms(Statistic):
    needs = ("sumsq", "numel")

    def compute(self, p: dict[str, np.ndarray]) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.sqrt(p["sumsq"] / np.where(p["numel"] == 0, np.nan, p["numel"]))
