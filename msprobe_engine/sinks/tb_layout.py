"""The custom-scalars layout: one chart per statistic of the layers of a kind.

Tags are ``<kind>/<path>/[<role>/]<stat>``. Paths that differ only in their first number
(the layer index: ``layers.3.mlp.0``, ``transformer.h.11.attn``) are the same sublayer at
different depths: one multiline chart shows that statistic for all of them
(``grad norm`` / ``layers.*.mlp.0.weight``); the rest of a kind share one chart.
"""
from __future__ import annotations

import re
from typing import Iterable, NamedTuple

from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.custom_scalar import layout_pb2, metadata

LAYER_KINDS = ("actv", "actv_grad", "grad", "param", "optim")
DT_STRING = 7  # tensorflow's DataType of a string tensor
_LAYER_INDEX = re.compile(r"(?<![^.])\d+(?![^.:])")  # a whole dotted component that is a number
OTHER = "other"


class TagParts(NamedTuple):
    kind: str
    path: str
    role: str
    stat: str


def parse_tag(tag: str) -> TagParts | None:
    """The parts of a per-layer tag; None for every other tag (train/, Health/, grad/global/norm)."""
    parts = tag.split("/")
    if parts[0] not in LAYER_KINDS or len(parts) not in (3, 4) or tag == "grad/global/norm":
        return None
    return TagParts(parts[0], parts[1], parts[2] if len(parts) == 4 else "", parts[-1])


def layer_pattern(path: str) -> str | None:
    """``layers.3.mlp.0`` -> ``layers.*.mlp.0``; None for a path without a number."""
    match = _LAYER_INDEX.search(path)
    return None if match is None else f"{path[:match.start()]}*{path[match.end():]}"


def build_layout(tags: Iterable[str], health: Iterable[str]) -> layout_pb2.Layout:
    """A `Health` category (loss and gradient norm, alerts so far, learning rate, throughput,
    memory, non-finite counts, open alerts, skipped steps, the worst deviation), then one
    category per kind, role and statistic (closed, but for the gradient norm)."""
    health = list(health)
    categories = [layout_pb2.Category(title="Health", chart=[
        _chart(title, [rf"^Health/{pattern}$"]) for title, pattern in
        (("loss and gradient norm", "(loss|grad_norm)"), ("alerts so far (episodes started)", "alerts"),
         ("learning rate", "lr"), ("throughput (per second)", "(tokens|samples)_per_s"),
         ("memory (MiB)", r"memory/.*"), ("non-finite elements by kind", r"non_finite/.*"),
         ("alerts (1: an episode is open)", r"open_alert/.*"), ("skipped steps", "skipped"),
         ("worst deviation from the running average", "worst_deviation"))
        if any(re.match(rf"^Health/{pattern}$", tag) for tag in health)])]
    groups: dict[tuple[str, str, str], dict[str, list[str]]] = {}
    for tag in tags:
        parts = parse_tag(tag)
        if parts is None:
            continue
        charts = groups.setdefault((parts.kind, parts.role, parts.stat), {})
        charts.setdefault(layer_pattern(parts.path) or OTHER, []).append(parts.path)
    for (kind, role, stat), charts in groups.items():
        layered = {pattern: paths for pattern, paths in charts.items() if pattern != OTHER and len(paths) > 1}
        lone = [path for pattern, paths in charts.items() if pattern not in layered for path in paths]
        prefix = f"^{re.escape(kind)}/"
        suffix = f"{'/' + re.escape(role) if role else ''}/{re.escape(stat)}$"
        content = [_chart(f"{kind} {stat}: {pattern}", [prefix + _any_layer(pattern) + suffix])
                   for pattern in layered]
        if lone:
            content.append(_chart(f"{kind} {stat}: {OTHER}", [f"{prefix}({'|'.join(map(re.escape, lone))}){suffix}"]))
        title = " ".join(filter(None, (kind, role, stat)))
        categories.append(layout_pb2.Category(title=title, chart=content,
                                              closed=(kind, stat) != ("grad", "norm")))
    return layout_pb2.Layout(category=categories)


def layout_value(layout: layout_pb2.Layout) -> Summary.Value:
    """The layout as the custom-scalars plugin reads it (its config tag, a string tensor)."""
    tensor = TensorProto(dtype=DT_STRING, string_val=[layout.SerializeToString()], tensor_shape=TensorShapeProto())
    return Summary.Value(tag=metadata.CONFIG_SUMMARY_TAG, metadata=metadata.create_summary_metadata(),
                         tensor=tensor)


def _any_layer(pattern: str) -> str:
    """The regex of a layer pattern: its `*` matches any layer index."""
    return re.escape(pattern).replace(re.escape("*"), r"\d+")


def _chart(title: str, regexes: list[str]) -> layout_pb2.Chart:
    return layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=regexes))
