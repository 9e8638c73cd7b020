"""Sink configs shared by tests."""
from msprobe_engine.stats import STATISTICS
from msprobe_engine.sinks.tb_layout import LAYER_KINDS

#: the tensorboard sink writing every tag of the records (by default it keeps the norms of
#: activations and gradients of the per-layer tags)
EVERY_TAG_TENSORBOARD = {"name": "tensorboard", "layer_kinds": list(LAYER_KINDS),
                         "layer_stats": list(STATISTICS.names())}

#: metrics of the monitor's own cost (times, syncs), so differ between ranks and runs that
#: compute the same numbers
TIMING_TAGS = frozenset({"Health/monitor_ms"})
SELF_METERING = "monitor/"


def untimed(metrics: dict) -> dict:
    """`metrics` without the monitor's own cost."""
    return {tag: value for tag, value in metrics.items()
            if tag not in TIMING_TAGS and not tag.startswith(SELF_METERING)}
