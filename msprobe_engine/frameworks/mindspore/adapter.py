"""The MindSpore framework as the core sees it (`registry.load_framework("mindspore")`).

Cell hooks need the monitor's per-step tensor batch, so a MindSpore net is monitored
through `msprobe_integrations.mindspore` (`MindSporeMonitor`, `MonitorCallback`), which
installs them; `attach` here says so instead of half-monitoring the net.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from msprobe_engine.frameworks.mindspore import backend

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor


class MindSporeFramework:
    """mindspore.nn.Cell networks (PyNative mode for hooks)."""

    name = "mindspore"
    dump_format = "mindspore"
    backend = backend

    def attach(self, monitor: "Monitor", model: Any, optimizer: Any) -> list[Any]:
        raise TypeError("Monitor.attach: a MindSpore Cell is monitored through "
                        "msprobe_integrations.mindspore.MindSporeMonitor(net, optimizer, config) "
                        "(or MonitorCallback for Model.train)")

    def replay_host(self) -> None:
        return None

    def dump_session(self) -> type:
        from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger
        return MindSporePrecisionDebugger


FRAMEWORK = MindSporeFramework()
