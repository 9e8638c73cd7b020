"""`module_dump(module, name)` / `module_dump_end()`: the predecessor's dump of one module as a unit.

Between the two calls, `module` (not its submodules) is recorded as
``Module.<name>.<Class>.forward.<n>`` / ``.backward.<n>`` / ``.parameters_grad.<n>``, and the
APIs called inside it are not recorded (the predecessor switches its API capture off for the
span). The module's hooks are installed at the first call and stay until the session closes;
outside the span they return at once. At L0 and mix the level's own module hooks already
record every submodule: module_dump then changes nothing (the predecessor does the same).
"""
from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from msprobe_engine.frameworks.torch.capture.api import push_mode, remove_mode

if TYPE_CHECKING:
    from msprobe_engine.frameworks.torch.capture.session import PrecisionDebugger

log = logging.getLogger("msprobe_engine")


class ModuleDump:
    """The module_dump spans of one dump session (PyTorch, level L1)."""

    def __init__(self, session: "PrecisionDebugger") -> None:
        self.session = session
        self.on = False
        self.handles: list = []
        self._hooked: dict[int, str] = {}

    def begin(self, module: torch.nn.Module, name: str) -> None:
        """Start recording `module` as `name`; API capture is off until `end`."""
        session = self.session
        if session.config.level != "L1":
            log.info("msprobe dump: module_dump(%s): level %s already records every module", name,
                     session.config.level)
            return
        session.prepare()
        if id(module) not in self._hooked:
            self._hook(module, f"Module.{name}.{type(module).__name__}")
        self.on = True
        if session.api_mode is not None:
            remove_mode(session.api_mode)

    def end(self) -> None:
        """Back to the level's own recording (API capture on again while the session collects)."""
        if not self.on:
            return
        self.on = False
        session = self.session
        if session.api_mode is not None and session.recorder is not None and session.recorder.active:
            push_mode(session.api_mode)

    def _hook(self, module: torch.nn.Module, key: str) -> None:
        recorder = self.session.recorder
        self._hooked[id(module)] = key
        self.handles.append(module.register_forward_pre_hook(partial(self._pre, recorder, key), with_kwargs=True))
        self.handles.append(module.register_forward_hook(partial(self._post, recorder), with_kwargs=True,
                                                         always_call=True))
        for param_name, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                self.handles.append(param.register_hook(partial(self._param_grad, recorder, key, param_name)))

    def _pre(self, recorder: Any, key: str, module, args, kwargs) -> None:
        if self.on:
            recorder.module_begin(key, module, args, kwargs)

    def _post(self, recorder: Any, module, args, kwargs, output) -> None:
        recorder.module_end(module, args, kwargs, output)  # returns at once unless `_pre` began this call

    @staticmethod
    def _param_grad(recorder: Any, key: str, name: str, grad: torch.Tensor) -> None:
        recorder.param_grad(key, name, grad)  # returns at once unless the module ran while recording

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._hooked.clear()
