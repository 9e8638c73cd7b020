"""`numel`: the element count."""
import numpy as np

from msprobe_engine.stats.registry import Statistic, register_statistic


@register_statistic("numel")
class Numel(Statistic):
    needs = ("numel",)

    def compute(self, p: dict[str, np.ndarray]) -> np.ndarray:
        return p["numel"]
