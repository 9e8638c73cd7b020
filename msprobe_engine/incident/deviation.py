"""Each row's norm against its own running average, kept on the host after the transfer.

The deviation of a row is its fold change, ``max(norm / average, average / norm)``: 1 for
a row at its average, 1000 for one a thousand times above (or below) it, inf for a
non-finite norm. Rows seen fewer than `warmup` times have deviation 1. Non-finite norms do
not enter the average. MoE router rows (token counts, per-token entropies: `stats.router`) are
no tensor norms and have deviation 1 (an expert without a token would be an infinite fold);
their own rules judge them.
"""
from __future__ import annotations

import numpy as np

from msprobe_engine.incident.culprit import row_name
from msprobe_engine.incident.graph import HIDDEN_KINDS
from msprobe_engine.stats import P_NUMEL, P_SUMSQ, router
from msprobe_engine.stats.table import MetricKey, StatTable


class RunningNorms:
    """Exponential running averages of every row's norm (one numpy update per table)."""

    def __init__(self, smoothing: float = 0.9, warmup: int = 3) -> None:
        self.smoothing = smoothing
        self.warmup = warmup
        self._slot: dict[MetricKey, int] = {}
        self._average = np.zeros(0)
        self._seen = np.zeros(0, dtype=np.int64)
        self._last: tuple[list[MetricKey], np.ndarray, np.ndarray] = ([], np.zeros(0, dtype=np.int64),
                                                                       np.zeros(0, dtype=bool))

    def deviation(self, table: StatTable) -> np.ndarray:
        """Fold change of each row of `table` against the averages so far (no update)."""
        slots = self._slots(table.keys)
        norms, empty = _norms(table)
        empty = empty | self._last[2]
        average, seen = self._average[slots], self._seen[slots]
        with np.errstate(divide="ignore", invalid="ignore"):
            fold = np.maximum(norms / average, average / norms)
        fold = np.where(np.isfinite(norms), fold, np.inf)
        fold = np.where(empty | (seen < self.warmup) | np.isnan(fold), 1.0, fold)
        return fold

    def update(self, table: StatTable) -> None:
        """Fold the finite norms of `table` into the averages."""
        slots = self._slots(table.keys)
        norms, empty = _norms(table)
        ok = np.isfinite(norms) & ~empty & ~self._last[2]
        slots, norms = slots[ok], norms[ok]
        first = self._seen[slots] == 0
        old = self._average[slots]
        self._average[slots] = np.where(first, norms, self.smoothing * old + (1 - self.smoothing) * norms)
        self._seen[slots] += 1

    def _slots(self, keys: list[MetricKey]) -> np.ndarray:
        if keys == self._last[0]:
            return self._last[1]
        new = [k for k in keys if k not in self._slot]
        for key in new:
            self._slot[key] = len(self._slot)
        if new:
            self._average = np.concatenate([self._average, np.zeros(len(new))])
            self._seen = np.concatenate([self._seen, np.zeros(len(new), dtype=np.int64)])
        slots = np.array([self._slot[k] for k in keys], dtype=np.int64)
        self._last = (list(keys), slots, np.array([k.kind == router.KIND for k in keys], dtype=bool))
        return slots


def _norms(table: StatTable) -> tuple[np.ndarray, np.ndarray]:
    """Each row's norm, and which rows are empty (their norm means nothing)."""
    return np.sqrt(table.partials[:, P_SUMSQ]), table.partials[:, P_NUMEL] == 0


def top_deviations(table: StatTable, fold: np.ndarray, k: int) -> list[dict]:
    """The `k` rows (metrics only) that deviate most from their running average, most first."""
    rows = [i for i, key in enumerate(table.keys) if key.kind not in HIDDEN_KINDS and key.kind != "train"]
    rows.sort(key=lambda i: -fold[i])
    norms, _ = _norms(table)
    return [{"row": row_name(table.keys[i]), "norm": float(norms[i]), "deviation": float(fold[i])}
            for i in rows[:k] if fold[i] > 1.0]
