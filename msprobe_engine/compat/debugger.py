"""The predecessor's `PrecisionDebugger`, `module_dump` and `module_dump_end` (PyTorch).

The same calls as ``msprobe.pytorch``: one debugger per process (constructing it again returns
the first one, as there), whose ``start(model)``, ``stop()``, ``step()`` and ``save(...)``
work on the instance and on the class (``PrecisionDebugger.step()``). The dump itself is this
project's (`msprobe_engine.frameworks.torch.capture.session.PrecisionDebugger`): the same
config.json, the same layout and names. Level ``debug`` records only what `save` is given
(``debug.json``, see `frameworks.torch.capture.debug_save`).
"""
from __future__ import annotations

import atexit
import threading
from pathlib import Path
from typing import Any

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump.config import DumpConfig
from msprobe_engine.registry import load_framework

#: the dump_path of the predecessor's shipped default config (used when neither config nor dump_path is given)
DEFAULT_DUMP_PATH = "./dump_path"
DEBUG_LEVEL = "debug"
_lock = threading.RLock()


class PrecisionDebugger:
    """The predecessor's debugger; see the module docstring."""

    _instance: "PrecisionDebugger | None" = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "PrecisionDebugger":
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
        from msprobe_engine.frameworks.torch.capture.debug_save import DebugSave
        from msprobe_engine.frameworks.torch.capture.module_dump import ModuleDump
        from msprobe_engine.frameworks.torch.capture.session import _rank_and_world

        overrides = {"task": task, "dump_path": None if dump_path is None else str(dump_path), "step": step}
        wanted_level = level if level is not None else _configured_level(config_path)
        self.debug_level = wanted_level == DEBUG_LEVEL
        overrides["level"] = "L1" if self.debug_level else level
        if config_path is None and dump_path is None:
            overrides["dump_path"] = DEFAULT_DUMP_PATH
        session_class = load_framework("torch").dump_session()
        self.session = session_class(config_path, model=model, **overrides)
        self.config: DumpConfig = self.session.config
        if self.debug_level and self.config.task not in ("statistics", "tensor"):
            raise ConfigError(f"level: 'debug' goes with task statistics or tensor, not {self.config.task!r}")
        self.model = model
        self.debug = DebugSave(self.config.dump_path, self.config.task, self.config.predecessor_format == "1.x",
                               self.session.writer) if self.debug_level else None
        self.module_dumper = ModuleDump(self.session)
        self.session._hooks.append(self.module_dumper)
        self._rank = _rank_and_world()[0]
        self._closed = False
        self._ready = True
        atexit.register(self.close)  # the predecessor's scripts never close: what step() closed is written

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
                instance.session.start(model if model is not None else instance.model)

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
            if instance.debug is not None:
                instance.debug.finish_step(instance.session.current_step, instance._rank)
            instance.session.step()

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
                                          and config.wants_rank(instance._rank or 0)):
            return
        with _lock:
            instance.debug.save(variable, name, save_backward)

    def close(self) -> None:
        """Write what is still open and wait for the writer (this project's call; also at exit)."""
        with _lock:
            if self._closed:
                return
            self._closed = True
            if self.debug is not None:
                self.debug.finish_step(self.session.current_step, self._rank)
            self.session.close()
        atexit.unregister(self.close)

    @classmethod
    def _get(cls) -> "PrecisionDebugger":
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
