"""The predecessor's `PrecisionDebugger`, `module_dump` and `module_dump_end` (PyTorch).

The same calls as ``msprobe.pytorch``: one debugger per process (constructing it again returns
the first one, as there), whose ``start(model)``, ``stop()``, ``step()`` and ``save(...)``
work on the instance and on the class (``PrecisionDebugger.step()``). The dump itself is this
project's dump session (`msprobe_engine.dump.facade.PrecisionDebugger`): the same config.json,
the same layout and names. `CompatDebugger` is the framework-neutral part (the MindSpore
drop-in, `compat.mindspore`, is another subclass). Level ``debug`` records only what `save` is given
(``debug.json``, see `frameworks.torch.capture.debug_save`).
"""
from __future__ import annotations

import atexit
import threading
from pathlib import Path
from typing import Any

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump.config import DumpConfig

#: the dump_path of the predecessor's shipped default config (used when neither config nor dump_path is given)
DEFAULT_DUMP_PATH = "./dump_path"
DEBUG_LEVEL = "debug"
_lock = threading.RLock()


class CompatDebugger:
    """The predecessor's debugger over this project's dump session (`dump.facade`), for the
    framework named by `FRAMEWORK`: one per process, its calls on the class or the instance."""

    FRAMEWORK = ""
    _instance: "CompatDebugger | None" = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "CompatDebugger":
        with _lock:
            if cls._instance is None:
                instance = super().__new__(cls)
                instance._ready = False
                cls._instance = instance
            return cls._instance

    def __init__(self, config_path: str | Path | None = None, task: str | None = None,
                 dump_path: str | Path | None = None, level: str | None = None, model: Any = None,
                 step: list | None = None) -> None:
        """`config_path`: the predecessor's config.json; `task`, `dump_path`, `level`, `step`
        override its keys; `model`: the model `start()` hooks when given none."""
        if self._ready:
            return
        from msprobe_engine.dump.facade import PrecisionDebugger as DumpSession

        overrides = {"task": task, "dump_path": None if dump_path is None else str(dump_path), "step": step}
        wanted_level = level if level is not None else _configured_level(config_path)
        self.debug_level = wanted_level == DEBUG_LEVEL
        overrides["level"] = "L1" if self.debug_level else level
        if config_path is None and dump_path is None:
            overrides["dump_path"] = DEFAULT_DUMP_PATH
        self.session = DumpSession(config_path, model=model, framework=self.FRAMEWORK, **overrides)
        self.config: DumpConfig = self.session.config
        if self.debug_level and self.config.task not in ("statistics", "tensor"):
            raise ConfigError(f"level: 'debug' goes with task statistics or tensor, not {self.config.task!r}")
        self.model = model
        self._attach()
        self._closed = False
        self._ready = True
        atexit.register(self.close)  # the predecessor's scripts never close: what step() closed is written

    # ---- what a framework adds ---------------------------------------------------------------
    def _attach(self) -> None:
        """Set up the framework's parts of the debugger (after the session is built)."""

    def _started(self, model: Any) -> None:
        """Called by `start` after the session started collecting on `model`."""

    def _step_args(self) -> tuple:
        """What the session's `step` is given."""
        return ()

    def _step_closing(self) -> None:
        """Called before the session closes a step (or closes)."""

    # ---- the predecessor's calls (on the class or the instance) ----------------------------
    @classmethod
    def start(cls, model: Any = None, token_range: Any = None, rank_id: Any = None) -> None:
        """Start collecting (hooks `model`, or the constructor's model, at the first call)."""
        for key, value in (("token_range", token_range), ("rank_id", rank_id)):
            if value is not None:
                raise ConfigError(f"start: {key}={value!r}: inference token selection is not implemented here; "
                                  "select steps and ranks in the config")
        instance = cls._get()
        with _lock:
            if not instance.debug_level:
                model = model if model is not None else instance.model
                instance.session.start(model)
                instance._started(model)

    @classmethod
    def stop(cls) -> None:
        """Stop collecting until the next `start`."""
        instance = cls._get()
        with _lock:
            if not instance.debug_level:
                instance.session.stop()

    @classmethod
    def step(cls) -> None:
        """Close the step: its files go to the writer, counters restart."""
        instance = cls._get()
        with _lock:
            instance._step_closing()
            instance.session.step(*instance._step_args())

    def close(self) -> None:
        """Write what is still open and wait for the writer (this project's call; also at exit)."""
        with _lock:
            if self._closed:
                return
            self._closed = True
            self._step_closing()
            self.session.close()
        atexit.unregister(self.close)

    @classmethod
    def _get(cls) -> "CompatDebugger":
        if cls._instance is None or not cls._instance._ready:
            raise ConfigError("PrecisionDebugger must be created before start/stop/step/save/module_dump are called")
        return cls._instance

    @classmethod
    def _forget(cls) -> None:
        """Close the process's debugger and allow a new one (tests, notebooks)."""
        with _lock:
            if cls._instance is not None and cls._instance._ready:
                cls._instance.close()
            cls._instance = None


class PrecisionDebugger(CompatDebugger):
    """The predecessor's PyTorch debugger (``msprobe.pytorch``); see the module docstring."""

    FRAMEWORK = "torch"
    _instance: "PrecisionDebugger | None" = None

    def _attach(self) -> None:
        from msprobe_engine.frameworks.torch.capture.debug_save import DebugSave
        from msprobe_engine.frameworks.torch.capture.module_dump import ModuleDump

        self.debug = None
        if self.debug_level:
            self.session.prepare()
            self.debug = DebugSave(self.config.dump_path, self.config.task, self.config.predecessor_format == "1.x",
                                   self.session.writer)
        self.module_dumper = ModuleDump(self.session)
        self.session.add_hooks(self.module_dumper)

    def _step_closing(self) -> None:
        if self.debug is not None:
            self.debug.finish_step(self.session.current_step, self.session.rank)

    @classmethod
    def save(cls, variable: Any, name: str, save_backward: bool = True) -> None:
        """Level debug: record `variable` as ``<name>.<n>.debug`` (and its gradients); other
        levels, steps and ranks not dumped: nothing (as in the predecessor)."""
        instance = cls._get()
        if not isinstance(name, str) or not isinstance(save_backward, bool):
            raise ConfigError(f"save: expected save(variable, name: str, save_backward: bool), "
                              f"got name={name!r}, save_backward={save_backward!r}")
        config = instance.config
        if instance.debug is None or not (config.wants_step(instance.session.current_step)
                                          and config.wants_rank(instance.session.rank or 0)):
            return
        with _lock:
            instance.debug.save(variable, name, save_backward)


def module_dump(module: Any, dump_name: str) -> None:
    """Record `module` as ``Module.<dump_name>.<Class>...`` (its inner APIs are not recorded)
    until `module_dump_end`."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"module_dump: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(dump_name, str) or not dump_name:
        raise ConfigError(f"module_dump: dump_name must be a non-empty string, got {dump_name!r}")
    instance = PrecisionDebugger._get()
    with _lock:
        instance.module_dumper.begin(module, dump_name)


def module_dump_end() -> None:
    """End the span of `module_dump`."""
    instance = PrecisionDebugger._get()
    with _lock:
        instance.module_dumper.end()


def _configured_level(config_path: str | Path | None) -> str | None:
    """The ``level`` of the config file, read once before the dump config validates it."""
    if config_path is None:
        return None
    from msprobe_engine.config.loader import read_file

    data = read_file(Path(config_path))
    return data.get("level") if isinstance(data, dict) else None
