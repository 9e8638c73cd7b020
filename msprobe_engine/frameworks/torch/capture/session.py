"""`PrecisionDebugger` for PyTorch: the dump session with torch's hooks and API capture.

See `msprobe_engine.dump.session` for the session's calls; torch is imported here only.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from msprobe_engine.config.errors import ConfigError
from msprobe_engine.dump.session import DumpSession, check_names
from msprobe_engine.frameworks.torch import backend as torch_backend
from msprobe_engine.frameworks.torch.capture.api import ApiCatalog, ApiMode, push_mode, remove_mode
from msprobe_engine.frameworks.torch.capture.operators import OperatorNames
from msprobe_engine.frameworks.torch.capture.modules import DumpModuleHooks, module_keys
from msprobe_engine.frameworks.torch.capture.recorder import Recorder, tensor_crc32


class PrecisionDebugger(DumpSession):
    """The PyTorch dump session (L0 modules, L1 APIs, mix)."""

    framework = "pytorch"

    # ---- set-up ------------------------------------------------------------------------
    def _setup(self, model: Any) -> None:
        if self.config.level in ("L0", "mix") and model is None:
            raise ConfigError(f"level {self.config.level} dumps modules: pass the model, start(model)")
        self.rank, world = _rank_and_world()
        self.config.check_ranks(world)
        catalog = ApiCatalog()
        modules = module_keys(model) if model is not None else {}
        check_names(self.config, modules, catalog)
        self._operators = OperatorNames() if self.config.level in ("L1", "mix") else None
        self._recorder = Recorder(self.config, torch_backend, catalog, self._emit_tensors, self._operators)
        self._mode = ApiMode(self._recorder.api_call)
        if model is not None:
            self._hook_model(model)

    def _hook_model(self, model: Any) -> None:
        if self.config.level in ("L0", "mix"):
            self._hooks.append(DumpModuleHooks(self._recorder, model))
        self._hooked.add(id(model))

    def _activate(self) -> None:
        wanted = self.config.wants_step(self.current_step) and self.config.wants_rank(self.rank or 0)
        if not (self._running and wanted and self._recorder is not None) or self._recorder.active:
            return
        self._recorder.active = self._collected = True
        if self._operators is not None:
            self._operators.install()
        push_mode(self._mode)  # also in L0: it measures waiting tensors before in-place calls

    def _deactivate(self) -> None:
        if self._recorder is None or not self._recorder.active:
            return
        self._recorder.active = False
        remove_mode(self._mode)
        if self._operators is not None:
            self._operators.remove()

    def _tensor_writers(self) -> tuple[Any, Any]:
        """(save a tensor copy to a path, or None; its checksum, or None) as the config asks."""
        return (_torch_save if self.config.task == "tensor" else None,
                tensor_crc32 if self.config.summary_mode == "md5" else None)


def _torch_save(tensor: Any, path: Path) -> None:
    torch.save(tensor, path)


def _rank_and_world() -> tuple[int | None, int]:
    """(rank, world size): from torch.distributed, else from torchrun's environment, else (None, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), world) if world > 1 else (None, 1)
