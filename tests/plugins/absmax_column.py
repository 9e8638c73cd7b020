"""A user's partial column and the statistic that needs it: the largest magnitude, measured by
each backend's reducer (here torch's and numpy's), merged by max across micro-steps and ranks."""
import numpy as np
import torch

from msprobe_engine.stats import PartialColumn, Statistic, register_column, register_statistic

register_column(PartialColumn("absmax", 0.0, "max"),
                torch=lambda flat: torch.linalg.vector_norm(flat, ord=float("inf"), dtype=torch.float64),
                numpy=lambda flat: np.abs(flat).max())


@register_statistic("absmax")
class AbsMax(Statistic):
    needs = ("absmax",)

    def compute(self, p: dict[str, np.ndarray]) -> np.ndarray:
        return p["absmax"]
