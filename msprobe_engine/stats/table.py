"""Host-side statistics of one step: keyed rows, merged and finalized."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

import numpy as np

from msprobe_engine.stats import P_INF, P_NAN, P_SUMSQ, finalize
from msprobe_engine.stats.columns import merge_indices, n_columns


class MetricKey(NamedTuple):
    """What a row measures: kind (actv, actv_grad, grad, param, optim, train), the
    module or parameter path, and the role (output, input.0, exp_avg, ...; '' for none)."""
    kind: str
    path: str
    role: str = ""

    def tag(self, stat: str) -> str:
        """TensorBoard tag: `<kind>/<path>/[<role>/]<stat>`."""
        middle = f"{self.path}/{self.role}" if self.role else self.path
        return f"{self.kind}/{middle}/{stat}"


@dataclass
class StatTable:
    """Partial rows for unique keys in execution order (first appearance wins)."""
    keys: list[MetricKey]
    partials: np.ndarray  # [len(keys), n_columns()]
    metrics: dict[str, float] | None = field(default=None, repr=False)  # filled by the monitor
    #: the spread of the per-rank scalars over the data-parallel group (`stats.ranks.RankSpread`),
    #: when the reducer found one in this table's transfer
    ranks: Any = field(default=None, repr=False)
    _finalized: dict[str, np.ndarray] | None = field(default=None, repr=False)

    @classmethod
    def from_rows(cls, keys: Iterable[MetricKey], rows: np.ndarray) -> "StatTable":
        """Merge rows that share a key (micro-steps, repeated reads) into one."""
        keys = list(keys)
        if len(dict.fromkeys(keys)) == len(keys):  # the usual case: no key twice (one C-level pass)
            return cls(keys, np.asarray(rows, dtype=np.float64).reshape(-1, n_columns()))
        index: dict[MetricKey, int] = {}
        groups = np.fromiter((index.setdefault(key, len(index)) for key in keys), dtype=np.int64, count=len(keys))
        rows = np.asarray(rows, dtype=np.float64).reshape(-1, n_columns())
        merged = np.full((len(index), n_columns()), -0.0)  # -0.0 + x == x: the sums come out as merge's
        np.add.at(merged, groups, rows)  # row by row, in the order they came
        for columns, start, at in ((merge_indices("min"), np.inf, np.minimum.at),
                                   (merge_indices("max"), -np.inf, np.maximum.at)):
            for c in columns:
                merged[:, c] = start
                at(merged[:, c], groups, rows[:, c])
        return cls(list(index), merged)

    def finalized(self) -> dict[str, np.ndarray]:
        if self._finalized is None:
            self._finalized = finalize(self.partials)
        return self._finalized

    def select(self, kind: str) -> np.ndarray:
        """Boolean mask of the rows of one kind."""
        return np.fromiter((k.kind == kind for k in self.keys), dtype=bool, count=len(self.keys))

    def global_norm(self, kind: str) -> float:
        """sqrt of the summed squares of every row of `kind` (e.g. the global grad norm)."""
        mask = self.select(kind)
        return float(np.sqrt(self.partials[mask, P_SUMSQ].sum())) if mask.any() else float("nan")

    def non_finite(self) -> np.ndarray:
        """Boolean mask of the rows holding a nan or an inf."""
        return (self.partials[:, P_NAN] + self.partials[:, P_INF]) > 0
