"""`trend`: a norm growing steadily, caught before it overflows to inf or nan."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from msprobe_engine.fields import between, choices
from msprobe_engine.rules.base import Firing, Rule, register_rule
from msprobe_engine.rules.tags import TagMatcher, one_episode
from msprobe_engine.stats.table import StatTable

METHODS = ("slope", "zscore")


@register_rule("trend")
class TrendRule(Rule):
    """A watched norm (`metrics`: tags or globs) on a steady blow-up, while it is still finite.

    `method: slope`: the least-squares slope of log(norm) over the last `window` observations
    says the norm grows `factor` times (or more) over the window, and the fit is steady (its
    R^2 at least `min_r2`). `method: zscore`: log(norm) is more than `z` standard deviations
    above the mean of the tag's own history (the `window` observations before it), `steps`
    observations in a row. Zeros and non-finite values are not observations (the
    `non_finite` rule reports those)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Rule.Config):
        metrics: list[str] = field(default_factory=lambda: ["grad/*/norm", "actv/*/output*/norm"])
        method: str = field(default="slope", metadata=choices(*METHODS))
        window: int = field(default=20, metadata=between(3, 100_000))
        factor: float = field(default=10.0, metadata=between(1.0, 1e12))
        min_r2: float = field(default=0.8, metadata=between(0.0, 1.0))
        z: float = field(default=6.0, metadata=between(0.0, 1e6))
        steps: int = field(default=3, metadata=between(1, 100_000))

    def __init__(self, config: "TrendRule.Config") -> None:
        super().__init__(config)
        self.watched = TagMatcher(config.metrics)
        self._history: dict[str, deque[float]] = {}  # zscore: each tag's past log norms
        self._streak: dict[str, int] = {}
        self._fired: set[str] = set()  # the tags of the last evaluation's hits (what `blame` names)
        x = np.arange(config.window, dtype=np.float64)
        self._x = x - x.mean()  # centred steps of a full window, for the slope
        # slope: each tag's last `window` log norms in a ring (a row per tag ever seen, all tags
        # updated at once), with its count of observations (the next slot is count % window)
        self._rows: dict[str, int] = {}
        self._ring = np.zeros((0, config.window))
        self._count = np.zeros(0, dtype=np.int64)
        self._layout: tuple[list[str], np.ndarray] = ([], np.zeros(0, dtype=np.int64))  # tags -> rows

    def evaluate(self, table, stats, metrics) -> list[Firing]:
        if self.config.method == "slope":
            hits = self._slope_hits(list(self.watched.candidates(metrics)))
        else:
            hits = []
            for tag, value in self.watched.candidates(metrics):
                if math.isfinite(value) and value > 0:
                    history = self._history.get(tag)
                    if history is None:
                        history = self._history[tag] = deque(maxlen=self.config.window)
                    threshold = self._zscore(tag, history, math.log(value))
                    if threshold is not None:
                        hits.append((tag, value, threshold))
        self._fired = {tag for tag, _, _ in hits}
        return one_episode(self, hits)

    def _slope_hits(self, watched: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
        """Each observation (finite, positive) into its tag's ring; the hits among the tags whose
        window is full (all tags' windows fitted at once)."""
        if not watched:
            return []
        values = np.array([value for _, value in watched], dtype=np.float64)
        with np.errstate(invalid="ignore"):
            seen = np.flatnonzero(np.isfinite(values) & (values > 0))
        rows = self._rows_of([tag for tag, _ in watched])[seen]
        window = self.config.window
        # math.log, as the zscore method takes it (numpy's may differ in the last bit)
        self._ring[rows, self._count[rows] % window] = [math.log(v) for v in values[seen].tolist()]
        self._count[rows] += 1
        full = self._count[rows] >= window
        if not full.any():
            return []
        rows, seen = rows[full], seen[full]
        oldest_first = (self._count[rows][:, None] + np.arange(window)) % window
        thresholds = self._slopes(self._ring[rows[:, None], oldest_first])
        return [(watched[i][0], watched[i][1], threshold) for i, threshold in zip(seen.tolist(), thresholds)
                if threshold is not None]

    def _rows_of(self, tags: list[str]) -> np.ndarray:
        """The ring rows of `tags` (new tags get new rows); looked up once per layout of tags."""
        known, rows = self._layout
        if tags == known:
            return rows
        for tag in tags:
            if tag not in self._rows:
                self._rows[tag] = len(self._rows)
        if len(self._rows) > len(self._count):
            grow = len(self._rows) - len(self._count)
            self._ring = np.concatenate([self._ring, np.zeros((grow, self.config.window))])
            self._count = np.concatenate([self._count, np.zeros(grow, dtype=np.int64)])
        rows = np.array([self._rows[tag] for tag in tags], dtype=np.int64)
        self._layout = (tags, rows)
        return rows

    def blame(self, table: StatTable, deviation: np.ndarray) -> np.ndarray:
        """The rows whose norm grows (the tags that fired: a steady growth is rarely 3x its
        running average on one step), and those far above their average."""
        fired = np.array([key.tag("norm") in self._fired for key in table.keys], dtype=bool)
        return fired | (deviation > 3.0) if fired.size else deviation > 3.0

    def _slopes(self, y: np.ndarray) -> list[float | None]:
        """For each full window of log norms (a row of `y`, oldest first): the norm the window
        started from times `factor` where the window grows `factor` x with a steady fit, else None."""
        start = y[:, 0].copy()
        y -= y.mean(axis=1, keepdims=True)
        xx = float(self._x @ self._x)
        slope = y @ self._x / xx
        spread = np.einsum("ij,ij->i", y, y)
        with np.errstate(divide="ignore", invalid="ignore"):
            r2 = np.where(spread == 0, 1.0, slope * slope * xx / spread)
        grows = (slope * (self.config.window - 1) >= math.log(self.config.factor)) & (r2 >= self.config.min_r2)
        log_factor = math.log(self.config.factor)
        return [math.exp(s + log_factor) if g else None for s, g in zip(start.tolist(), grows.tolist())]

    def _zscore(self, tag: str, history: deque[float], level: float) -> float | None:
        """Fires after `steps` values in a row `z` deviations above the history; the values
        that fire do not join the history. Returns the norm `z` deviations above its mean."""
        if len(history) < self.config.window:
            history.append(level)
            return None
        past = np.fromiter(history, dtype=np.float64)
        mean, std = float(past.mean()), float(past.std())
        limit = mean + self.config.z * max(std, 1e-3)
        if level <= limit:
            history.append(level)
            self._streak[tag] = 0
            return None
        streak = self._streak[tag] = self._streak.get(tag, 0) + 1
        return math.exp(limit) if streak >= self.config.steps else None

    def state_dict(self) -> dict[str, Any]:
        """Each tag's history (its last log norms, oldest first) and streak, whatever the method."""
        history = {tag: list(h) for tag, h in self._history.items()}
        window = self.config.window
        for tag, row in self._rows.items():
            count = int(self._count[row])
            if count:
                kept = min(count, window)
                history[tag] = self._ring[row, (count - kept + np.arange(kept)) % window].tolist()
        return {"history": history, "streak": dict(self._streak)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        window = self.config.window
        histories = {str(tag): [float(v) for v in h][-window:] for tag, h in state.get("history", {}).items()}
        self._streak = {str(k): int(v) for k, v in state.get("streak", {}).items()}
        self._history, self._rows = {}, {}
        self._ring, self._count = np.zeros((0, window)), np.zeros(0, dtype=np.int64)
        self._layout = ([], np.zeros(0, dtype=np.int64))
        if self.config.method != "slope":
            self._history = {tag: deque(h, maxlen=window) for tag, h in histories.items()}
            return
        rows = self._rows_of(list(histories))
        for row, h in zip(rows.tolist(), histories.values()):
            self._ring[row, :len(h)] = h
            self._count[row] = len(h)
