"""`seed_all`: the predecessor's reproducibility switch for PyTorch runs.

Seeds Python's `random`, NumPy, torch (CPU and every CUDA device) and ``PYTHONHASHSEED``;
``mode=True`` turns on deterministic algorithms (``torch.use_deterministic_algorithms``,
cuDNN deterministic, no cuDNN benchmark; ``CUBLAS_WORKSPACE_CONFIG`` set to ``:4096:8`` when
unset, which deterministic cuBLAS needs). ``rm_dropout=True`` makes every dropout of
``torch.nn.functional`` (and so of ``nn.Dropout*``) use p = 0, process-wide, as the
predecessor does; it is the one place this project replaces framework functions, and only
when asked.
"""
from __future__ import annotations

import functools
import os
import random

import numpy as np
import torch
import torch.nn.functional as F

from msprobe_engine.frameworks.seed_check import check_seed_arguments
#: the dropout functions that `rm_dropout` sets to p = 0
DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


def seed_all(seed: int = 1234, mode: bool = False, rm_dropout: bool = False, is_enhanced: bool = False) -> None:
    """Seed every generator; `mode`: deterministic algorithms; `rm_dropout`: dropout p = 0;
    `is_enhanced` (the predecessor's NPU option) is checked and changes nothing on CPU/CUDA."""
    check_seed_arguments(seed, mode=mode, rm_dropout=rm_dropout, is_enhanced=is_enhanced)
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if mode:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(mode)
    torch.backends.cudnn.deterministic = mode
    torch.backends.cudnn.benchmark = not mode and torch.backends.cudnn.benchmark
    if rm_dropout:
        remove_dropout()


def remove_dropout() -> None:
    """Every dropout function of ``torch.nn.functional`` runs with p = 0 from now on."""
    for name in DROPOUTS:
        original = getattr(F, name, None)
        if original is None or getattr(original, "_msprobe_no_dropout", False):
            continue
        setattr(F, name, _without_dropout(original))


def _without_dropout(original):
    @functools.wraps(original)
    def no_dropout(input, p: float = 0.5, *args, **kwargs):  # noqa: A002 (torch's own argument name)
        return original(input, 0.0, *args, **kwargs)
    no_dropout._msprobe_no_dropout = True
    return no_dropout
