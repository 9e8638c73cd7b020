"""The built-in rules, one file each (importing this module registers them)."""
from msprobe_engine.rules import (dead_experts, expert_collapse, misreported_grad_norm, non_finite,  # noqa: F401
                                  rank_outlier, replica_drift, spike, trend)
