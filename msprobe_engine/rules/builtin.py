"""The built-in rules, one file each (importing this module registers them)."""
from msprobe_engine.rules import non_finite, spike, trend  # noqa: F401
