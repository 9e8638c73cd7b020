"""The rule interface: a registered class with its own `Config`, evaluated on host statistics.

A rule sees a step's table (partial rows), its finalized statistics and its tagged
metrics, and returns what fires now (`Firing`); `AlertTracker` (`rules.episodes`) turns
that into episodes. A rule also says which rows an incident should blame (`blame`) and
carries its running state across a restart (`state_dict` / `load_state_dict`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from msprobe_engine.fields import between, choices
from msprobe_engine.registry import Registry
from msprobe_engine.stats.table import StatTable

ACTIONS = ("continue", "skip", "stop")


@dataclass(slots=True)
class Firing:
    """A rule condition that holds on this step."""
    rule: str
    episode: str  # what identifies the episode (one alert per episode)
    tag: str      # the first metric that fired, in execution order
    value: float
    threshold: float | None
    action: str
    also: tuple[str, ...] = ()  # other tags firing in the same episode (e.g. parent modules)
    cooldown: int = 0  # clean evaluations after the last firing that still belong to the episode
    #: every (tag, value, threshold) that fired, the lead's included, in execution order: when
    #: given, episodes are tracked per tag (`rules.episodes`); empty: one episode per `episode`
    parts: tuple[tuple[str, float, float | None], ...] = ()


class Rule:
    """Base of every alert rule; subclasses register with `@register_rule(name)`."""

    name: ClassVar[str]
    #: True: evaluated once per step on all of the step's rows (before and after the optimizer
    #: step together), after the optimizer step; never in a decision before it
    whole_step: ClassVar[bool] = False

    @dataclass(kw_only=True, slots=True)
    class Config:
        """`rule`: the registered name; `action`: what a firing does to the training;
        `cooldown`: an episode ends after this many clean monitored steps in a row (0: at the
        first), so the aftermath of one event (a disturbed training settling) is no new alert."""
        rule: str
        action: str = field(default="continue", metadata=choices(*ACTIONS))
        cooldown: int = field(default=0, metadata=between(0, 1_000_000))

    def __init__(self, config: "Rule.Config") -> None:
        self.config = config
        #: False while a control file switches the rule off (it is not evaluated)
        self.enabled = True

    @property
    def action(self) -> str:
        return self.config.action

    def evaluate(self, table: StatTable, stats: dict[str, np.ndarray], metrics: dict[str, float]) -> list[Firing]:
        """What fires on this table (empty list: nothing)."""
        raise NotImplementedError

    def blame(self, table: StatTable, deviation: np.ndarray) -> np.ndarray:
        """Boolean mask of the rows an incident of this rule blames, given each row's
        deviation from its running average (x its usual norm); the first culprit is found
        among them. Default: rows deviating more than 3x."""
        return deviation > 3.0

    def state_dict(self) -> dict[str, Any]:
        """Running state to carry across a restart (plain Python types)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""


RULES: Registry[type[Rule]] = Registry("rule", "msprobe_engine.rules.builtin")
register_rule = RULES.register


def build_rules(configs: list[Rule.Config]) -> list[Rule]:
    """One rule object per configured rule, in config order."""
    return [RULES.get(config.rule)(config) for config in configs]
