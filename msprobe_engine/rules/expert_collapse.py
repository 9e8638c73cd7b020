"""`expert_collapse`: a mixture-of-experts router sending (almost) every token to one expert."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from msprobe_engine.fields import between
from msprobe_engine.rules.base import Firing, Rule, register_rule
from msprobe_engine.stats import router
from msprobe_engine.stats.table import StatTable


@register_rule("expert_collapse")
class ExpertCollapseRule(Rule):
    """A router whose busiest expert received at least `share` of the tokens it routed on this
    step (`router/<layer>/load/<e>` over `router/<layer>/tokens`; 1.0: every token). Every router
    that collapses on one step is one episode, named after the first router (in execution order)
    and its busiest expert; the other collapsed routers are listed with it."""

    @dataclass(kw_only=True, slots=True)
    class Config(Rule.Config):
        share: float = field(default=0.9, metadata=between(0.0, 1.0))
        min_tokens: int = field(default=1, metadata=between(1, 10**12))  # fewer tokens routed: not judged

    def evaluate(self, table, stats, metrics) -> list[Firing]:
        hits = [(h, h.top_share) for h in router.router_health(table)
                if h.tokens >= self.config.min_tokens and h.top_share >= self.config.share]
        if not hits:
            return []
        tags = [router.load_tag(h.path, int(np.argmax(h.loads))) for h, _ in hits]
        return [Firing(self.name, self.name, tags[0], hits[0][1], self.config.share, self.action,
                       also=tuple(tags[1:]), cooldown=self.config.cooldown,
                       parts=tuple((tag, share, self.config.share) for tag, (_, share) in zip(tags, hits)))]

    def blame(self, table: StatTable, deviation: np.ndarray) -> np.ndarray:
        """The rows of the collapsed routers."""
        collapsed = {h.path for h in router.router_health(table)
                     if h.tokens >= self.config.min_tokens and h.top_share >= self.config.share}
        return np.array([k.kind == router.KIND and k.path in collapsed for k in table.keys], dtype=bool)
