"""The MindSpore framework as the core sees it (`registry.load_framework("mindspore")`).

`attach` installs the `wiring.CellWiring` of a net: Cell hooks (PyNative mode), the optimizer
Cell's hooks, and the step-end work that measures the step's tensors in one backend call
(`msprobe_integrations.mindspore.MindSporeMonitor` is the same with `step_end(loss, grads)`).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from msprobe_engine.frameworks.mindspore import backend

if TYPE_CHECKING:
    from msprobe_engine.contract import MonitorPort
    from msprobe_engine.frameworks.mindspore.replay import MindSporeReplayHost
    from msprobe_engine.frameworks.mindspore.wiring import CellWiring


class MindSporeFramework:
    """mindspore.nn.Cell networks (PyNative mode for hooks)."""

    name = "mindspore"
    #: the `framework` field of its dumps
    dump_format = "mindspore"
    backend = backend

    def attach(self, monitor: "MonitorPort", model: Any, optimizer: Any) -> list["CellWiring"]:
        """The hooks on the net `model` and its optimizer Cell; the step's tensors are measured
        at `monitor.step_end`."""
        from msprobe_engine.frameworks.mindspore.wiring import CellWiring
        return [CellWiring(monitor, model, optimizer)]

    def replay_host(self) -> "MindSporeReplayHost":
        """Replays in PyNative mode, also of a compiled step (`replay.MindSporeReplayHost`)."""
        from msprobe_engine.frameworks.mindspore.replay import MindSporeReplayHost
        return MindSporeReplayHost()

    def dump_session(self) -> type:
        from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger
        return MindSporePrecisionDebugger

    def load_tensor_file(self, file: Path, mapped: bool = False) -> Any:
        """Its dumps hold numpy files (``.npy``), read by the dump reader itself."""
        return np.load(file, mmap_mode="r" if mapped else None, allow_pickle=False)

    def numpy_copier(self, buffer: np.ndarray) -> Callable[[int, Any], None]:
        """Copies a 1-D MindSpore tensor into row `i` of `buffer` (through one host copy)."""
        def copy(i: int, tensor: Any) -> None:
            np.copyto(buffer[i, :len(tensor)], tensor.asnumpy(), casting="unsafe")
        return copy

    def precheck(self) -> None:
        """MindSpore has no API pre-check (its registration says `precheck=False`)."""
        return None


FRAMEWORK = MindSporeFramework()
