"""The MindSpore side of a step replay (`msprobe_engine.incident.replay.ReplayHost`).

A step that runs compiled (GRAPH_MODE, a `mindspore.jit` step) applies its optimizer inside the
graph, so the monitor decides at the step's end, after the weights changed. So when a step
starts through `Monitor.run_step` and the last step ran compiled (or none ran yet), the host
copies every Parameter of the nets first (one compiled launch): the weights the step starts
from. The replay, on the training thread, inside that step's end (or, in PyNative mode, inside
its optimizer step as on the torch side):

- saves every Parameter of the nets and their optimizers (weights, moments, step counters,
  BatchNorm statistics: one compiled launch) and puts the step's starting weights back;
- runs the step function eagerly: PYNATIVE_MODE and ``MS_JIT=0`` (MindSpore's own switch: a
  `mindspore.jit` function and a GRAPH_MODE Cell then run as Python), so the Cell hooks of the
  monitor (`wiring.CellWiring.replay_hooks`) and of a tensor dump (`MindSporePrecisionDebugger`,
  L0 or mix) see every watched Cell's call, and the first culprit is named as in PyNative;
- afterwards gives every Parameter its saved value back (bitwise), and the mode and ``MS_JIT``
  their values: the training goes on exactly as without the replay (its optimizer step, run
  eagerly, leaves no trace).

RNG: Python's `random`, numpy's global generator and MindSpore's default generator
(`mindspore.get_rng_state`, which the `mint` random ops draw from); a Primitive with its own
seed (e.g. `ops.Dropout` of `nn.Dropout`) keeps its own state and is not rewound.
"""
from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import mindspore as ms
import numpy as np
from mindspore import Parameter, ops

from msprobe_engine.frameworks.mindspore.cell_hooks import HeldState, held_copies


class ReplayedWiring(Protocol):
    """What a replay needs of a net's wiring (`wiring.CellWiring`, which imports this module)."""

    optim: Any

    def replay_hooks(self) -> contextlib.AbstractContextManager[None]:
        """The watched Cells' hooks for the length of a replayed step."""


@dataclass
class StepStart:
    """What a step starts from: the RNG states and, for a compiled step, its nets' Parameters."""
    mindspore: Any
    python: tuple
    numpy: tuple
    params: HeldState


def _unique(params: list[Parameter]) -> list[Parameter]:
    seen: dict[int, Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


class MindSporeReplayHost:
    """Replay support for the nets in `models` (`Monitor.attach` adds them) and the wirings that
    monitor them (`wirings`: each adds itself at its first step)."""

    def __init__(self) -> None:
        self.models: list[Any] = []
        self.wirings: list[ReplayedWiring] = []
        #: the last step ran compiled (its optimizer where no hook runs), or none ran yet
        self.compiled = True
        #: a step function started through `run_step` in this step (the wirings decide before
        #: measuring the step's end then; reset by them at the step's end)
        self.step_call = False

    def _params(self) -> list[Parameter]:
        return _unique([p for net in self.models for _, p in net.parameters_and_names()])

    def capture_rng(self) -> StepStart:
        self.step_call = True
        return StepStart(ms.get_rng_state(), random.getstate(), np.random.get_state(),
                         held_copies(self._params()) if self.compiled else [])

    def restore_rng(self, state: StepStart) -> None:
        ms.set_rng_state(state.mindspore)
        random.setstate(state.python)
        np.random.set_state(state.numpy)
        for param, value in state.params:  # the weights the step started from (a compiled step)
            ops.assign(param, value)

    @contextlib.contextmanager
    def isolated(self) -> Iterator[None]:
        """Every Parameter of the nets and optimizers saved, the step run eagerly; afterwards the
        Parameters, the mode and ``MS_JIT`` are as they were."""
        optimizers = [w.optim.optimizer for w in self.wirings if w.optim.optimizer is not None]
        saved = held_copies(_unique(self._params() + [p for o in optimizers for _, p in o.parameters_and_names()]))
        mode, jit = ms.get_context("mode"), os.environ.get("MS_JIT")
        ms.set_context(mode=ms.PYNATIVE_MODE)
        os.environ["MS_JIT"] = "0"
        try:
            yield
        finally:
            if jit is None:
                os.environ.pop("MS_JIT", None)
            else:
                os.environ["MS_JIT"] = jit
            ms.set_context(mode=mode)
            for param, value in saved:
                ops.assign(param, value)

    @contextlib.contextmanager
    def tensor_dump(self, path: Path, step: int, level: str) -> Iterator[None]:
        """A tensor dump (``path/step<step>/rank*/``, the reference's MindSpore format) of every net
        while the block runs, and the monitor's hooks on the replayed step (`replay_hooks`: what
        they collect is measured when the block ends)."""
        from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger

        debugger = MindSporePrecisionDebugger({"task": "tensor", "dump_path": str(path), "level": level})
        debugger.current_step = step
        with contextlib.ExitStack() as stack:
            for net in self.models:
                debugger.start(net)
            stack.callback(debugger.close)
            stack.callback(debugger.stop)
            for wiring in self.wirings:
                stack.enter_context(wiring.replay_hooks())
            yield
