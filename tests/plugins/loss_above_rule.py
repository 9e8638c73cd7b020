"""A user's rule: the loss above a fixed limit (its own key, `limit`)."""
from dataclasses import dataclass

from msprobe_engine.rules import Firing, Rule, register_rule


@register_rule("loss_above")
class LossAbove(Rule):
    @dataclass(kw_only=True, slots=True)
    class Config(Rule.Config):
        limit: float = 1.0

    def evaluate(self, table, stats, metrics):
        loss = metrics.get("train/loss")
        if loss is None or not loss > self.config.limit:
            return []
        return [Firing(self.name, self.name, "train/loss", loss, self.config.limit, self.action)]
