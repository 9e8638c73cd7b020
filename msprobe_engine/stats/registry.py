"""The statistics a user can ask for (`stats:` in the config), one registered class each.

A statistic is computed on the host from a table's partial columns (`stats.columns`),
so a new one needs no backend change::

    from msprobe_engine.stats import Statistic, register_statistic

    @register_statistic("rms")
    class Rms(Statistic):
        needs = ("sumsq", "numel")

        def compute(self, p):               # p: column name -> float64 array
            return np.sqrt(p["sumsq"] / p["numel"])

`needs` tells the backend which optional partial columns to take (the zero count costs
a pass over the data and is taken only when a chosen statistic needs it).
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from msprobe_engine.registry import Registry

#: partial columns a backend takes only when asked
OPTIONAL_COLUMNS = frozenset({"zero_count"})


class Statistic:
    """One user-facing statistic computed from partial columns (see the module docstring)."""

    name: ClassVar[str]
    needs: ClassVar[tuple[str, ...]] = ()

    def compute(self, p: dict[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError


STATISTICS: Registry[type[Statistic]] = Registry("statistic", "msprobe_engine.stats.statistics")
register_statistic = STATISTICS.register


def optional_columns(names: list[str] | tuple[str, ...]) -> set[str]:
    """The optional partial columns the named statistics need."""
    return {col for name in names for col in STATISTICS.get(name).needs if col in OPTIONAL_COLUMNS}
