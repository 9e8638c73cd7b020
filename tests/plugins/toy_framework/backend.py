"""The toy framework's statistics backend: the five backend functions, on the host (numpy)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from msprobe_engine.stats import numpy_backend
from tests.plugins.toy_framework.model import Tensor

concat, to_host, scalar, pick = numpy_backend.concat, numpy_backend.to_host, numpy_backend.scalar, numpy_backend.pick


def partial_stats(tensors: Sequence[Any], count_zeros: bool = False, deferred: bool = False) -> np.ndarray:
    return numpy_backend.partial_stats([t.data if isinstance(t, Tensor) else t for t in tensors], count_zeros)
