"""Sink configs shared by tests."""
from msprobe_engine.stats import STATISTICS
from msprobe_engine.sinks.tb_layout import LAYER_KINDS

#: the tensorboard sink writing every tag of the records (by default it keeps the norms of
#: activations and gradients of the per-layer tags)
EVERY_TAG_TENSORBOARD = {"name": "tensorboard", "layer_kinds": list(LAYER_KINDS),
                         "layer_stats": list(STATISTICS.names())}

#: metrics that are times, so differ between ranks and runs that compute the same numbers
TIMING_TAGS = frozenset({"Health/monitor_ms"})


def untimed(metrics: dict) -> dict:
    """`metrics` without the timing tags."""
    return {tag: value for tag, value in metrics.items() if tag not in TIMING_TAGS}
