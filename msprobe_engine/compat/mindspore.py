"""A drop-in for the predecessor's MindSpore API (PyNative): change one import line.

::

    # from msprobe.mindspore import PrecisionDebugger, seed_all
    from msprobe_engine.compat.mindspore import PrecisionDebugger, seed_all

`PrecisionDebugger(config_path, task, dump_path, level, step)` with ``start(net)``, ``stop()``,
``step()`` on the instance or the class, one per process, over this project's MindSpore dump
session (`frameworks.mindspore.capture.session.MindSporePrecisionDebugger`): the same
config.json, dump layout and names (``Cell.``/``Functional.``/``Primitive.`` entries). As in the
predecessor, ``step()`` takes no gradients: the gradients of the net's trainable parameters
are caught by hooks on them (``Parameter.register_hook``, PyNative) and dumped as
``parameters_grad`` at `step`. Level ``debug`` (`save`), `TrainerMon`, `MsprobeStep` and
GRAPH_MODE's `save`/`step` are not provided here: importing them names what to use.
"""
from __future__ import annotations

import os
import random
from functools import partial
from typing import Any

from msprobe_engine.compat.debugger import CompatDebugger
from msprobe_engine.frameworks.seed_check import check_seed_arguments
from msprobe_engine.errors import ConfigError

__all__ = ["PrecisionDebugger", "seed_all"]
#: the predecessor's MindSpore names not provided, and what to use instead
NOT_PROVIDED = {
    "TrainerMon": "msprobe_integrations.mindspore (this project's MindSpore monitor)",
    "MsprobeStep": "PrecisionDebugger.start/stop/step around each step",
    "MsprobeInitStep": "PrecisionDebugger.start/stop/step around each step",
    "save": "a statistics or tensor dump at level L1 (level 'debug' is PyTorch's here)",
    "save_grad": "a statistics or tensor dump at level L1 (level 'debug' is PyTorch's here)",
    "step": "PrecisionDebugger.step()",
}


class _ParameterGrads:
    """The last gradient of each hooked parameter, by parameter name (until `take`)."""

    def __init__(self) -> None:
        self.grads: dict[str, Any] = {}
        self.handles: list = []
        self.hooked: set[int] = set()

    def watch(self, net: Any) -> None:
        for param in net.trainable_params():
            if id(param) not in self.hooked:
                self.hooked.add(id(param))
                self.handles.append(param.register_hook(partial(self._arrived, param.name)))

    def _arrived(self, name: str, grad: Any) -> None:
        self.grads[name] = grad  # returns None: the gradient is left as it is

    def take(self) -> dict[str, Any]:
        grads, self.grads = self.grads, {}
        return grads

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.hooked.clear()


class PrecisionDebugger(CompatDebugger):
    """The predecessor's MindSpore debugger (``msprobe.mindspore``); see the module docstring."""

    FRAMEWORK = "mindspore"
    _instance: "PrecisionDebugger | None" = None

    def __init__(self, config_path: Any = None, task: str | None = None, dump_path: Any = None,
                 level: str | None = None, step: list | None = None) -> None:
        """The predecessor's MindSpore signature (no `model`: the net is given to `start`)."""
        super().__init__(config_path, task=task, dump_path=dump_path, level=level, step=step)

    def _attach(self) -> None:
        if self.debug_level:
            raise ConfigError("level: 'debug' (PrecisionDebugger.save) is implemented for PyTorch only here; "
                              "use level L1 with task statistics or tensor")
        self.grads = _ParameterGrads()
        self.session.add_hooks(self.grads)

    def _started(self, model: Any) -> None:
        if model is not None:
            self.grads.watch(model)

    def _step_args(self) -> tuple:
        grads = self.grads.take()
        return (grads,) if grads else ()


def seed_all(seed: int = 1234, mode: bool = False, rm_dropout: bool = False) -> None:
    """The predecessor's MindSpore `seed_all`: seeds MindSpore, Python, NumPy and
    ``PYTHONHASHSEED``; `mode`: deterministic kernels (``set_context(deterministic="ON")``)."""
    import mindspore as ms
    import numpy as np

    check_seed_arguments(seed, mode=mode, rm_dropout=rm_dropout)
    if rm_dropout:
        raise ConfigError("seed_all: rm_dropout=True is not implemented for MindSpore here; "
                          "build the net with dropout p=0 (keep_prob=1.0) instead")
    os.environ["PYTHONHASHSEED"] = str(seed)
    ms.set_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    ms.set_context(deterministic="ON" if mode else "OFF")
    os.environ["HCCL_DETERMINISTIC"] = str(mode)


def __getattr__(name: str):
    if name in NOT_PROVIDED:
        raise ImportError(f"msprobe_engine.compat.mindspore: {name} (msprobe.mindspore's) is not provided; "
                          f"use {NOT_PROVIDED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
