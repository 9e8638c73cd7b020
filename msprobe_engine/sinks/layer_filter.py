"""Which per-layer tags a sink keeps by default: the kinds in `layer_kinds` with the statistics
in `layer_stats` (every `Health/*`, `train/*`, `alert/*` and other non-layer tag is kept). The
TensorBoard, W&B and MLflow sinks share it, so a metric service gets the landing page's tags,
not every statistic of every layer (metrics.jsonl keeps those)."""
from __future__ import annotations

from dataclasses import dataclass, field

from msprobe_engine.fields import choices
from msprobe_engine.sinks.base import Sink
from msprobe_engine.sinks.tb_layout import LAYER_KINDS, parse_tag
from msprobe_engine.stats import STATISTICS


@dataclass(kw_only=True, slots=True)
class LayerChoice(Sink.Config):
    """`layer_kinds`, `layer_stats`: the per-layer tags kept (others are dropped)."""
    layer_kinds: list[str] = field(default_factory=lambda: ["actv", "grad"], metadata=choices(*LAYER_KINDS))
    layer_stats: list[str] = field(default_factory=lambda: ["norm"], metadata={"choices": STATISTICS})


class LayerFilter:
    """`filter(tag)`: whether a sink configured with a `LayerChoice` keeps `tag` (memoised)."""

    def __init__(self, config: LayerChoice) -> None:
        self.kinds, self.stats = config.layer_kinds, config.layer_stats
        self._kept: dict[str, bool] = {}

    def __call__(self, tag: str) -> bool:
        kept = self._kept.get(tag)
        if kept is None:
            parts = parse_tag(tag)
            kept = self._kept[tag] = parts is None or (parts.kind in self.kinds and (
                parts.stat in self.stats or parts.stat not in STATISTICS))
        return kept

    def metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The kept items of `metrics`."""
        return {tag: value for tag, value in metrics.items() if self(tag)}
