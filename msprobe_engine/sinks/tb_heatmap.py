"""A heatmap (rows x steps) as one TensorBoard image summary value, with its legend."""
from __future__ import annotations

import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.image import metadata as image_metadata

from msprobe_engine.sinks.heatmap import NormHistory, enlarge, heatmap_rgb, legend, png
from msprobe_engine.sinks.tb_layout import DT_STRING


def heatmap_value(tag: str, title: str, history: NormHistory, matrix: np.ndarray) -> Summary.Value:
    """`matrix` (rows x steps, from `history`) drawn as a PNG image under `tag`; `title` and the
    rows' legend are its description."""
    rgb = enlarge(heatmap_rgb(matrix))
    height, width = rgb.shape[:2]
    tensor = TensorProto(dtype=DT_STRING, string_val=[str(width).encode(), str(height).encode(), png(rgb)],
                         tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=3)]))
    meta = image_metadata.create_summary_metadata(title, legend(history, matrix))
    return Summary.Value(tag=tag, metadata=meta, tensor=tensor)
