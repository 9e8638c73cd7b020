"""Host-side statistics of one step: keyed rows, merged and finalized."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

import numpy as np

from msprobe_engine.stats import N_COLUMNS, P_INF, P_NAN, P_SUMSQ, finalize, merge


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
    partials: np.ndarray  # [len(keys), N_COLUMNS]
    metrics: dict[str, float] | None = field(default=None, repr=False)  # filled by the monitor
    _finalized: dict[str, np.ndarray] | None = field(default=None, repr=False)

    @classmethod
    def from_rows(cls, keys: Iterable[MetricKey], rows: np.ndarray) -> "StatTable":
        """Merge rows that share a key (micro-steps, repeated reads) into one."""
        keys = list(keys)
        index: dict[MetricKey, int] = {}
        groups = np.empty(len(keys), dtype=np.int64)
        for i, key in enumerate(keys):
            groups[i] = index.setdefault(key, len(index))
        if len(index) == len(keys):
            return cls(keys, np.asarray(rows, dtype=np.float64).reshape(-1, N_COLUMNS))
        merged = np.empty((len(index), N_COLUMNS))
        for g in range(len(index)):
            merged[g] = merge(rows[groups == g])
        return cls(list(index), merged)

    def finalized(self) -> dict[str, np.ndarray]:
        if self._finalized is None:
            self._finalized = finalize(self.partials)
        return self._finalized

    def select(self, kind: str) -> np.ndarray:
        """Boolean mask of the rows of one kind."""
        return np.array([k.kind == kind for k in self.keys], dtype=bool)

    def global_norm(self, kind: str) -> float:
        """sqrt of the summed squares of every row of `kind` (e.g. the global grad norm)."""
        mask = self.select(kind)
        return float(np.sqrt(self.partials[mask, P_SUMSQ].sum())) if mask.any() else float("nan")

    def non_finite(self) -> np.ndarray:
        """Boolean mask of the rows holding a nan or an inf."""
        return (self.partials[:, P_NAN] + self.partials[:, P_INF]) > 0
