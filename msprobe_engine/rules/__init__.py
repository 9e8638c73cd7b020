"""Anomaly rules evaluated on a step's host-side statistics (no extra transfer).

Each rule is a registered class (`Rule`, `register_rule`) with its own `Config`; a rule
returns what is firing now, and `AlertTracker` turns that into episodes, so an alert is
reported when it starts and when it ends, never every step.
"""
from msprobe_engine.rules.base import ACTIONS, RULES, Firing, Rule, build_rules, register_rule
from msprobe_engine.rules.episodes import AlertTracker

__all__ = ["ACTIONS", "RULES", "AlertTracker", "Firing", "Rule", "build_rules", "register_rule"]
