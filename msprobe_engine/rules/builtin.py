"""The built-in rules, one file each (importing this module registers them)."""
from msprobe_engine.rules import misreported_grad_norm, non_finite, replica_drift, spike, trend  # noqa: F401
