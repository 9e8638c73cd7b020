"""`PrecisionDebugger` for PyTorch: the dump session with torch's hooks and API capture.

See `msprobe_engine.dump.session` for the session's calls; torch is imported here only.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from msprobe_engine.config.errors import ConfigError
from msprobe_engine.dump.session import DumpSession, check_names
from msprobe_engine.dump.tasks import require_support
from msprobe_engine.dump.writer import TENSOR_TASKS
from msprobe_engine.frameworks.torch import backend as torch_backend
from msprobe_engine.frameworks.torch.capture.api import ApiCatalog, ApiMode, push_mode, remove_mode
from msprobe_engine.frameworks.torch.capture.free_benchmark import FreeBenchmark
from msprobe_engine.frameworks.torch.capture.live_compare import LiveCompareRecorder
from msprobe_engine.frameworks.torch.capture.operators import OperatorNames
from msprobe_engine.frameworks.torch.capture.modules import DumpModuleHooks, module_keys
from msprobe_engine.frameworks.torch.capture.overflow import OverflowRecorder
from msprobe_engine.frameworks.torch.capture.recorder import Recorder, tensor_crc32
from msprobe_engine.frameworks.torch.grad_probe import GradProbe

#: the tasks the PyTorch session implements
TORCH_TASKS = ("statistics", "tensor", "overflow_check", "grad_probe", "free_benchmark", "diff_check")
#: tasks whose `_hook_model` is their own `watch(model)` (no module hooks)
NO_MODULE_TASKS = ("grad_probe", "free_benchmark")
#: the recorder of each task that records calls like the dump (the default: `Recorder`)
RECORDERS = {"overflow_check": OverflowRecorder, "diff_check": LiveCompareRecorder}
#: the recorder attribute that `task_results` shows, per task
RESULTS = {"overflow_check": "overflows", "diff_check": "divergences", "free_benchmark": "failed"}


class PrecisionDebugger(DumpSession):
    """The PyTorch dump session (L0 modules, L1 APIs, mix) and the debugger tasks
    (overflow_check, grad_probe, free_benchmark, diff_check; see `msprobe_engine.dump.tasks`)."""

    framework = "pytorch"

    # ---- set-up ------------------------------------------------------------------------
    def _setup(self, model: Any) -> None:
        task = self.config.task
        require_support(task, "PyTorch", TORCH_TASKS)
        self._operators: OperatorNames | None = None
        if self.config.level in ("L0", "mix") and model is None and task not in NO_MODULE_TASKS:
            raise ConfigError(f"level {self.config.level} dumps modules: pass the model, start(model)")
        self.rank, world = _rank_and_world()
        self.config.check_ranks(world)
        if task == "grad_probe":
            self._recorder = GradProbe(self.config, self.rank, self.writer)
            self._hooks.append(self._recorder)
            if model is not None:
                self._hook_model(model)
            return
        catalog = ApiCatalog()
        modules = module_keys(model) if model is not None and task not in NO_MODULE_TASKS else {}
        check_names(self.config, modules, catalog)
        self._operators = OperatorNames() if self.config.level in ("L1", "mix") else None
        if task == "free_benchmark":
            self._recorder = FreeBenchmark(self.config, catalog, self.rank, self.writer)
        else:
            recorder = RECORDERS.get(task, Recorder)
            self._recorder = recorder(self.config, torch_backend, catalog, self._emit_tensors, self._operators)
        self._mode = ApiMode(self._recorder.api_call)
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
        attribute = RESULTS.get(self.config.task)
        return list(getattr(self._recorder, attribute)) if attribute and self._recorder is not None else []

    def _hook_model(self, model: Any) -> None:
        if self.config.task in NO_MODULE_TASKS:
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
            push_mode(self._mode)  # also in L0: it measures waiting tensors before in-place calls

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
        return (_torch_save if self.config.task in TENSOR_TASKS else None,
                tensor_crc32 if self.config.summary_mode == "md5" else None)


def _torch_save(tensor: Any, file: Any) -> None:
    torch.save(tensor, file)


def _rank_and_world() -> tuple[int | None, int]:
    """(rank, world size): from torch.distributed, else from torchrun's environment, else (None, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), world) if world > 1 else (None, 1)
