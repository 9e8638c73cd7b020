"""`rank_outlier`: one rank of the data-parallel group holds what the others do not.

The reducer's merge carries a few per-rank scalars as (max, argmax) and (min, argmin) pairs in
its all-reduces (`stats.ranks`, `StatTable.ranks`), so every rank knows, without a gather:

- the rank holding the most nan/inf values (the alert's tag `ranks/rank<R>/nonfinite`, its
  value that count): a bad host, a bad shard of data, silent data corruption;
- a rank whose replicated gradient norm or loss is more than `factor` x the mean of the
  ranks between the highest and the lowest, or below 1/`factor` of it (`ranks/rank<R>/grad_norm`,
  `.../loss`; the value is the ratio): that mean stands in for the median, which needs every
  rank's value.

One alert per event (an episode per scalar and direction); every rank sees the same spread and
raises the same alert; incidents say it in words ("rank 2 of 4 holds the nan"). Nothing fires
where the reducer reports no spread (one process, MindSpore).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from msprobe_engine.fields import between
from msprobe_engine.rules.base import Firing, Rule, register_rule
from msprobe_engine.stats.ranks import RankSpread


def tag(rank: int, scalar: str) -> str:
    return f"ranks/rank{rank}/{scalar}"


@register_rule("rank_outlier")
class RankOutlierRule(Rule):
    """The odd rank, named: see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(Rule.Config):
        factor: float = field(default=10.0, metadata=between(1.0, 1e12))

    def evaluate(self, table, stats, metrics) -> list[Firing]:
        spread: RankSpread | None = table.ranks
        if spread is None or spread.world < 2:
            return []
        fired = []
        holder = spread.nonfinite_holder()
        if holder is not None:
            fired.append(Firing(self.name, f"{self.name}:nonfinite", tag(holder, "nonfinite"),
                                spread.get("nonfinite", "max"), 0.0, self.action, cooldown=self.config.cooldown))
        for extreme in spread.extremes(self.config.factor):
            way = "high" if extreme.high else "low"
            fired.append(Firing(self.name, f"{self.name}:{extreme.scalar}:{way}", tag(extreme.rank, extreme.scalar),
                                extreme.ratio, self.config.factor, self.action, cooldown=self.config.cooldown))
        return fired
