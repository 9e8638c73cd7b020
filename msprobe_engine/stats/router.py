"""Router health of mixture-of-experts layers, from a step's `router` rows (any framework).

A framework's router hooks (`frameworks/torch/router_hooks.py`) add, per router and
micro-batch, rows of kind `router` under the router's module path:

- `load.<e>`: a scalar, the number of token assignments expert `e` received (its `sum`
  is the expert's load; summed exactly over micro-batches and data-parallel ranks);
- `entropy`: one value per token, the entropy of the router's distribution over the
  experts divided by log(number of experts) (0: certain, 1: uniform); its count is the
  number of tokens routed;
- `topk_prob`: one value per token, the mean probability of the experts chosen for it;
- `z_loss`: one value per token, the squared log-sum-exp of its logits (the router z-loss of
  ST-MoE, before any coefficient; Megatron's `z_loss` logged value);
- `dropped` (routers with a capacity): a scalar, the token assignments the capacity limit
  dropped (top-k choices that reached no expert; summed like the loads);
- `aux_loss` (when the framework computes one): a scalar, the router's load-balancing loss of
  the micro-batch before its coefficient (averaged over micro-batches and ranks).

From them, per router (`<path>` is the router's module path), the tags::

    router/<path>/load/<e>      tokens assigned to expert e (sums to tokens x top-k)
    router/<path>/tokens        tokens routed
    router/<path>/imbalance     max load / mean load (1: balanced; top-k routing tops at experts/k)
    router/<path>/entropy       mean normalised router entropy
    router/<path>/topk_prob     mean probability of the chosen experts
    router/<path>/dead          experts that received no token on this step
    router/<path>/z_loss        mean squared log-sum-exp of the logits
    router/<path>/dropped       token assignments dropped by the capacity (routers with one)
    router/<path>/aux_loss      the framework's load-balancing loss, unscaled (when it has one)

A model-level load-balancing loss (transformers computes one over all of a model's routers) is an
`aux_loss` row under the model's path with no load rows: it gives only `router/<model>/aux_loss`.
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
Z_LOSS = "z_loss"
DROPPED = "dropped"
AUX_LOSS = "aux_loss"
#: the rows besides the loads, in the order a router lists them (`dropped`, `aux_loss`: optional)
OTHER_ROLES = (ENTROPY, TOPK_PROB, Z_LOSS, DROPPED, AUX_LOSS)


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
    and the row of each of `OTHER_ROLES` (-1: absent)."""
    path: str
    loads: np.ndarray
    entropy: int
    topk_prob: int
    z_loss: int = -1
    dropped: int = -1
    aux_loss: int = -1


def router_rows(keys: Sequence[MetricKey]) -> list[RouterRows]:
    """The routers of a key list, in the order their first row appears."""
    found: dict[str, dict] = {}
    for i, key in enumerate(keys):
        if key.kind != KIND:
            continue
        entry = found.setdefault(key.path, {"loads": {}, **dict.fromkeys(OTHER_ROLES, -1)})
        expert = expert_of(key)
        if expert is not None:
            entry["loads"][expert] = i
        elif key.role in OTHER_ROLES:
            entry[key.role] = i
    return [RouterRows(path, np.array([e["loads"][x] for x in sorted(e["loads"])], dtype=np.int64),
                       *(e[role] for role in OTHER_ROLES)) for path, e in found.items()]


@dataclass(frozen=True, slots=True)
class RouterHealth:
    """One router on one step."""
    path: str
    loads: np.ndarray  # tokens per expert
    tokens: float
    entropy: float
    topk_prob: float
    z_loss: float = float("nan")
    dropped: float | None = None  # None: the router has no capacity
    aux_loss: float | None = None  # None: the framework computes none

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
        out.append(RouterHealth(r.path, p[r.loads, P_SUM], tokens, _mean(p, r.entropy), _mean(p, r.topk_prob),
                                _mean(p, r.z_loss), float(p[r.dropped, P_SUM]) if r.dropped >= 0 else None,
                                _mean(p, r.aux_loss) if r.aux_loss >= 0 else None))
    return out


def router_metrics(health: Sequence[RouterHealth]) -> dict[str, float]:
    """The tags of the module docstring."""
    metrics: dict[str, float] = {}
    for h in health:
        base = f"{KIND}/{h.path}/"
        if not h.loads.size:  # a model-level loss, no router of its own
            if h.aux_loss is not None:
                metrics[base + AUX_LOSS] = h.aux_loss
            continue
        metrics.update({load_tag(h.path, e): float(v) for e, v in enumerate(h.loads)})
        metrics.update({base + "tokens": h.tokens, base + "imbalance": h.imbalance, base + ENTROPY: h.entropy,
                        base + TOPK_PROB: h.topk_prob, base + "dead": float(h.dead.size), base + Z_LOSS: h.z_loss})
        metrics.update({base + role: value for role, value in ((DROPPED, h.dropped), (AUX_LOSS, h.aux_loss))
                        if value is not None})
    return metrics


def _mean(p: np.ndarray, row: int) -> float:
    if row < 0 or p[row, P_NUMEL] == 0:
        return float("nan")
    return float(p[row, P_SUM] / p[row, P_NUMEL])
