"""`PrecisionDebugger` for PyTorch: the dump session with torch's hooks and API capture.

See `msprobe_engine.dump.session` for the session's calls; torch is imported here only.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump.recorder import RecorderContext, recorder_class, register_recorder, supported_tasks
from msprobe_engine.dump.session import DumpSession, check_names
from msprobe_engine.dump.task import require_support
from msprobe_engine.frameworks.torch import backend as torch_backend
from msprobe_engine.frameworks.torch.capture.api import ApiCatalog, ApiMode, push_mode, remove_mode
from msprobe_engine.frameworks.torch.capture.operators import OperatorNames
from msprobe_engine.frameworks.torch.capture.modules import DumpModuleHooks, module_keys
from msprobe_engine.frameworks.torch.capture.recorder import tensor_crc32

FRAMEWORK = "pytorch"
_CAPTURE = "msprobe_engine.frameworks.torch.capture"
#: the recorder of each task PyTorch implements (imported when a session of that task starts)
for _task, _recorder in (("statistics", f"{_CAPTURE}.recorder:Recorder"), ("tensor", f"{_CAPTURE}.recorder:Recorder"),
                         ("overflow_check", f"{_CAPTURE}.overflow:OverflowRecorder"),
                         ("grad_probe", "msprobe_engine.frameworks.torch.grad_probe:GradProbe"),
                         ("free_benchmark", f"{_CAPTURE}.free_benchmark:FreeBenchmark"),
                         ("diff_check", f"{_CAPTURE}.live_compare:LiveCompareRecorder")):
    register_recorder(FRAMEWORK, _task, _recorder)
#: the tasks the PyTorch session implements (built in; a plugin's `register_recorder` adds more)
TORCH_TASKS = supported_tasks(FRAMEWORK)


class PrecisionDebugger(DumpSession):
    """The PyTorch dump session (L0 modules, L1 APIs, mix) and the debugger tasks
    (overflow_check, grad_probe, free_benchmark, diff_check; see `msprobe_engine.dump.tasks`)."""

    framework = FRAMEWORK

    # ---- set-up ------------------------------------------------------------------------
    def _setup(self, model: Any) -> None:
        task = self.config.task
        require_support(task, "PyTorch", supported_tasks(FRAMEWORK))
        recorder = recorder_class(FRAMEWORK, task)
        self._operators: OperatorNames | None = None
        if self.config.level in ("L0", "mix") and model is None and not recorder.watches_model:
            raise ConfigError(f"level {self.config.level} dumps modules: pass the model, start(model)")
        self.rank, world = _rank_and_world()
        self.config.check_ranks(world)
        ctx = RecorderContext(self.config, self.rank, self.writer, self._emit_tensors, torch_backend)
        if not recorder.records_calls:
            self._recorder = recorder(ctx)
            self._hooks.append(self._recorder)
            if model is not None:
                self._hook_model(model)
            return
        ctx.catalog = ApiCatalog()
        modules = module_keys(model) if model is not None and not recorder.watches_model else {}
        check_names(self.config, modules, ctx.catalog)
        self._operators = ctx.operators = OperatorNames() if self.config.level in ("L1", "mix") else None
        self._recorder = recorder(ctx)
        # at L0 a recorder that measures at its hooks (`measures_at_hooks`) needs no API mode
        eager = self.config.level == "L0" and getattr(self._recorder, "measures_at_hooks", False)
        self._mode = None if eager else ApiMode(self._recorder.api_call)
        if model is not None:
            self._hook_model(model)

    def monitor(self, model: Any) -> None:
        """grad_probe (the predecessor's call): watch `model`'s gradients at every optimizer step."""
        if self.config.task != "grad_probe":
            raise ConfigError(f"monitor(model) is the grad_probe task's call; this config's task is "
                              f"{self.config.task!r}")
        self.start(model)

    @property
    def task_results(self) -> list:
        """So far: overflow_check (step, first overflowing call) per step that overflowed; diff_check
        (step, first divergent call); free_benchmark the failing outputs (`ResultRow`); else []."""
        return list(self._recorder.results) if self._recorder is not None else []

    def _hook_model(self, model: Any) -> None:
        if self._recorder.watches_model:
            self._recorder.watch(model)
        elif self.config.level in ("L0", "mix"):
            self._hooks.append(DumpModuleHooks(self._recorder, model))
        self._hooked.add(id(model))

    def _activate(self) -> None:
        wanted = self.config.wants_step(self.current_step) and self.config.wants_rank(self.rank or 0)
        if not (self._running and wanted and self._recorder is not None) or self._recorder.active:
            return
        self._recorder.active = self._collected = True
        if self._operators is not None:
            self._operators.install()
        if self._mode is not None:
            push_mode(self._mode)  # at L0 only for recorders measuring waiting tensors before in-place calls

    def _deactivate(self) -> None:
        if self._recorder is None or not self._recorder.active:
            return
        self._recorder.active = False
        if self._mode is not None:
            remove_mode(self._mode)
        if self._operators is not None:
            self._operators.remove()

    def _tensor_writers(self) -> tuple[Any, Any]:
        """(save a tensor copy to a path, or None; its checksum, or None) as the config asks."""
        return (_torch_save if self.config.task_class.saves_tensors else None,
                tensor_crc32 if self.config.summary_mode == "md5" else None)


def _torch_save(tensor: Any, path: str) -> None:
    torch.save(tensor, path)


def _rank_and_world() -> tuple[int | None, int]:
    """(rank, world size): from torch.distributed, else from torchrun's environment, else (None, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), world) if world > 1 else (None, 1)
