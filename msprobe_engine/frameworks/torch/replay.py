"""The torch side of a step replay (`msprobe_engine.incident.replay.ReplayHost`).

RNG state: torch's CPU generator, every generator of the current accelerator (when one is
initialised), Python's `random` and numpy's global generator. Gradients of the models'
parameters are set aside during the replay and module buffers (e.g. BatchNorm running
statistics) saved and copied back, so the replay leaves no trace in the training. Compiled
code runs eagerly during a replay (`torch.compiler.set_stance("force_eager")`, no recompilation),
so the replay's hooks name the culprit as in an eager run. The
tensor dump is a `PrecisionDebugger` tensor session of the replayed step.
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from msprobe_engine.frameworks.torch.optimizer_hooks import restore_grads, set_aside_grads


@dataclass
class RngState:
    cpu: torch.Tensor
    accelerator: list[torch.Tensor] | None
    python: tuple
    numpy: tuple


def _accelerator() -> Any:
    """The device module (torch.cuda, torch.npu, ...) of an initialised accelerator, or None."""
    if not torch.accelerator.is_available():
        return None
    module = torch.get_device_module(torch.accelerator.current_accelerator().type)
    initialised = getattr(module, "is_initialized", None)
    return module if initialised is None or initialised() else None


class TorchReplayHost:
    """Replay support for the torch models in `models` (`Monitor.attach` adds them)."""

    def __init__(self) -> None:
        self.models: list[torch.nn.Module] = []

    def capture_rng(self) -> RngState:
        device = _accelerator()
        return RngState(torch.get_rng_state(), device.get_rng_state_all() if device is not None else None,
                        random.getstate(), np.random.get_state())

    def restore_rng(self, state: RngState) -> None:
        torch.set_rng_state(state.cpu)
        device = _accelerator()
        if device is not None and state.accelerator is not None:
            device.set_rng_state_all(state.accelerator)
        random.setstate(state.python)
        np.random.set_state(state.numpy)

    @contextlib.contextmanager
    def isolated(self) -> Iterator[None]:
        """Gradients reset to None and buffers saved; afterwards both are as they were. Compiled
        code runs eagerly meanwhile."""
        params = [p for model in self.models for p in model.parameters()]
        held = set_aside_grads(params)
        buffers = [(b, b.detach().clone()) for model in self.models for b in model.buffers()]
        try:
            with torch.compiler.set_stance("force_eager"):
                yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            set_aside_grads(params)  # drop the replay's gradients
            restore_grads(held)

    @contextlib.contextmanager
    def tensor_dump(self, path: Path, step: int, level: str) -> Iterator[None]:
        """A tensor dump (``path/step<step>/rank*/``) of every model while the block runs."""
        from msprobe_engine.frameworks.torch.capture.session import PrecisionDebugger

        debugger = PrecisionDebugger({"task": "tensor", "dump_path": str(path), "level": level})
        debugger.current_step = step
        for model in self.models:
            debugger.start(model)
        try:
            yield
        finally:
            debugger.stop()
            debugger.close()
