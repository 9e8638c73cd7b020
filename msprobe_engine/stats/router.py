"""Router health of mixture-of-experts layers, from a step's `router` rows (any framework).

A framework's router hooks (`frameworks/torch/router_hooks.py`) add, per router and
micro-batch, rows of kind `router` under the router's module path:

- `load.<e>`: a scalar, the number of token assignments expert `e` received (its `sum`
  is the expert's load; summed exactly over micro-batches and data-parallel ranks);
- `entropy`: one value per token, the entropy of the router's distribution over the
  experts divided by log(number of experts) (0: certain, 1: uniform); its count is the
  number of tokens routed;
- `topk_prob`: one value per token, the mean probability of the experts chosen for it.

From them, per router (`<path>` is the router's module path), the tags::

    router/<path>/load/<e>      tokens assigned to expert e (sums to tokens x top-k)
    router/<path>/tokens        tokens routed
    router/<path>/imbalance     max load / mean load (1: balanced; top-k routing tops at experts/k)
    router/<path>/entropy       mean normalised router entropy
    router/<path>/topk_prob     mean probability of the chosen experts
    router/<path>/dead          experts that received no token on this step
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from msprobe_engine.stats.columns import P_NUMEL, P_SUM
from msprobe_engine.stats.table import MetricKey, StatTable

KIND = "router"
LOAD = "load"
ENTROPY = "entropy"
TOPK_PROB = "topk_prob"


def load_key(path: str, expert: int) -> MetricKey:
    """The row of expert `expert`'s load at the router `path`."""
    return MetricKey(KIND, path, f"{LOAD}.{expert}")


def load_tag(path: str, expert: int) -> str:
    return f"{KIND}/{path}/{LOAD}/{expert}"


def expert_of(key: MetricKey) -> int | None:
    """The expert whose load a row holds (None: not a load row)."""
    if key.kind == KIND and key.role.startswith(LOAD + "."):
        return int(key.role[len(LOAD) + 1:])
    return None


@dataclass(frozen=True, slots=True)
class RouterRows:
    """Where one router's rows are in a table: one load row per expert (in expert order),
    the entropy row and the top-k probability row (-1: absent)."""
    path: str
    loads: np.ndarray
    entropy: int
    topk_prob: int


def router_rows(keys: Sequence[MetricKey]) -> list[RouterRows]:
    """The routers of a key list, in the order their first row appears."""
    found: dict[str, dict] = {}
    for i, key in enumerate(keys):
        if key.kind != KIND:
            continue
        entry = found.setdefault(key.path, {"loads": {}, ENTROPY: -1, TOPK_PROB: -1})
        expert = expert_of(key)
        if expert is not None:
            entry["loads"][expert] = i
        elif key.role in (ENTROPY, TOPK_PROB):
            entry[key.role] = i
    return [RouterRows(path, np.array([e["loads"][x] for x in sorted(e["loads"])], dtype=np.int64),
                       e[ENTROPY], e[TOPK_PROB]) for path, e in found.items()]


@dataclass(frozen=True, slots=True)
class RouterHealth:
    """One router on one step."""
    path: str
    loads: np.ndarray  # tokens per expert
    tokens: float
    entropy: float
    topk_prob: float

    @property
    def imbalance(self) -> float:
        mean = self.loads.mean() if self.loads.size else 0.0
        return float(self.loads.max() / mean) if mean > 0 else float("nan")

    @property
    def dead(self) -> np.ndarray:
        """Experts that received no token."""
        return np.flatnonzero(self.loads == 0)

    @property
    def top_share(self) -> float:
        """The share of the routed tokens sent to the busiest expert (1: every token)."""
        return float(self.loads.max() / self.tokens) if self.tokens > 0 and self.loads.size else float("nan")


def router_health(table: StatTable, rows: Sequence[RouterRows] | None = None) -> list[RouterHealth]:
    """Every router of the table (`rows`: `router_rows(table.keys)`, when known)."""
    p = table.partials
    out = []
    for r in router_rows(table.keys) if rows is None else rows:
        tokens = float(p[r.entropy, P_NUMEL]) if r.entropy >= 0 else float("nan")
        out.append(RouterHealth(r.path, p[r.loads, P_SUM], tokens, _mean(p, r.entropy), _mean(p, r.topk_prob)))
    return out


def router_metrics(health: Sequence[RouterHealth]) -> dict[str, float]:
    """The tags of the module docstring."""
    metrics: dict[str, float] = {}
    for h in health:
        metrics.update({load_tag(h.path, e): float(v) for e, v in enumerate(h.loads)})
        base = f"{KIND}/{h.path}/"
        metrics.update({base + "tokens": h.tokens, base + "imbalance": h.imbalance, base + ENTROPY: h.entropy,
                        base + TOPK_PROB: h.topk_prob, base + "dead": float(h.dead.size)})
    return metrics


def _mean(p: np.ndarray, row: int) -> float:
    if row < 0 or p[row, P_NUMEL] == 0:
        return float("nan")
    return float(p[row, P_SUM] / p[row, P_NUMEL])
