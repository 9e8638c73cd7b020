"""The built-in statistics, one file each; importing this package registers them, in display order."""
from msprobe_engine.stats.statistics import min, max, mean, norm  # noqa: F401,I001 (order = display order)
from msprobe_engine.stats.statistics import nan_count, inf_count, zero_frac, numel  # noqa: F401,I001
