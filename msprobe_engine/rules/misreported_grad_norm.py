"""`misreported_grad_norm`: the training's own global gradient norm disagrees with the monitor's.

The training reports its norm through `monitor.report_grad_norm(value, max_norm)`
(`clip_grad_norm_`'s return, DeepSpeed's or Megatron's); the monitor's `grad/global/norm`
is merged exactly over the ranks and shards. A norm computed on one rank's shard only (the
classic FSDP bug: off by about the square root of the number of shards), summed twice over
tensor-parallel ranks, or taken before a reduction, disagrees with it.

The monitor reads the gradients after clipping: with `max_norm` the expected value is
min(reported, max_norm). A reported norm above `max_norm` cannot be checked against clipped
gradients beyond that (they measure `max_norm` whatever the true norm).

Timing: DeepSpeed's and Megatron's norms are known only once their optimizer step has run,
while the gradients are read before it. The rule is a `whole_step` rule: it is evaluated
once per step, after the optimizer step, on all of the step's rows together (at `step_end`;
when a skip/stop rule makes the monitor decide before the optimizer step, with the next
transfer, i.e. at the next step's decision or at `close`). So the norm may be reported any
time before `step_end`, and the rule never takes part in a pre-step decision: its action is
`continue` or `stop` (a stop takes effect at the next step's decision).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from msprobe_engine.fields import between, choices
from msprobe_engine.rules.base import Firing, Rule, register_rule

REPORTED = "train/reported_grad_norm"
MAX_NORM = "train/grad_clip_max_norm"
MERGED = "grad/global/norm"


@register_rule("misreported_grad_norm")
class MisreportedGradNormRule(Rule):
    """The reported global grad norm differs from the merged one by more than `tolerance`
    (relative); the alert's value is the reported norm, its threshold the merged one."""

    whole_step = True

    @dataclass(kw_only=True, slots=True)
    class Config(Rule.Config):
        # evaluated after the optimizer step: it cannot skip that step (see the module docstring)
        action: str = field(default="continue", metadata=choices("continue", "stop"))
        tolerance: float = field(default=1e-3, metadata=between(0.0, 1.0))

    def evaluate(self, table, stats, metrics) -> list[Firing]:
        reported, merged = metrics.get(REPORTED), metrics.get(MERGED)
        if reported is None or merged is None or not (math.isfinite(reported) and math.isfinite(merged)):
            return []
        expected = min(reported, metrics.get(MAX_NORM, math.inf))
        if abs(merged - expected) <= self.config.tolerance * max(abs(expected), abs(merged)):
            return []
        return [Firing(self.name, self.name, REPORTED, reported, merged, self.action)]
