"""`DumpSession`: the predecessor's dump session (`PrecisionDebugger`), framework-neutral part.

::

    debugger = PrecisionDebugger("config.json")          # or a dict, or keyword overrides
    for batch in data:
        debugger.start(model)                             # hooks go on at the first call
        loss = train_step(model, batch)                   # forward, backward, optimizer step
        debugger.stop()
        debugger.step()                                   # closes the step: dump.json is written
    debugger.close()                                      # waits for the writer, removes the hooks

or ``with PrecisionDebugger(cfg) as debugger:`` and ``with debugger.step_scope(model): ...``
per step. Steps and ranks outside the config's lists cost a flag check. Statistics stay on
the device until `step()`, which makes one host transfer; files are written by the engine's
background writer thread (`sinks.BackgroundWriter`) and committed atomically per step.
Without ``close()`` the session is closed when the process ends (normally, by an exception,
or by SIGTERM/SIGINT: `exit_guard`), so every step that `step()` closed is on disk.
A step whose files could not all be written whole is dropped: counted in `dropped_steps`
(why: `drop_reasons`), reported once, its ``.partial`` directory removed.
A framework's session (its `PrecisionDebugger`) adds the hooks and the capture.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from functools import partial
from pathlib import Path
from typing import Any, Iterator

from msprobe_engine import exit_guard
from msprobe_engine.errors import ConfigError
from msprobe_engine.dump.config import DumpConfig, DumpConfigSource, load_dump_config
from msprobe_engine.dump.schema import parse_entry_name
from msprobe_engine.dump.writer import StepFiles, StepIncomplete
from msprobe_engine.sinks.writer import BackgroundWriter

log = logging.getLogger("msprobe_engine")


class DumpSession:
    """A dump session; see the module docstring. `current_step` counts `step()` calls.

    The framework layer is `_setup`, `_hook_model`, `_activate`/`_deactivate` and
    `_tensor_writers` (PyTorch: `msprobe_engine.frameworks.torch.capture.session`,
    MindSpore: `msprobe_engine.frameworks.mindspore.capture.session`)."""

    #: dump.json's ``framework`` (and so its record format, see `dump.entry.FORMATS`)
    framework = ""

    def __init__(self, config: DumpConfigSource = None, *, config_path: str | Path | None = None,
                 model: Any = None, **overrides: Any) -> None:
        """`config` (or the predecessor's keyword `config_path`): a config file, dict or DumpConfig;
        keyword overrides use the config's keys (``level="L0"``, ``step=[1]``)."""
        self.config: DumpConfig = load_dump_config(config if config is not None else config_path, **overrides)
        self.current_step = 0
        self.steps_written = 0
        self.dropped_steps = 0
        #: why steps were dropped: reason -> count
        self.drop_reasons: dict[str, int] = {}
        self._drop_lock = threading.Lock()
        self.rank: int | None = None
        self._model = model
        self.writer = BackgroundWriter(self.config.queue_size, self.config.when_full, strict=self.config.strict)
        self._recorder: Any = None
        self._mode: Any = None
        self._hooks: list = []
        self._hooked: set[int] = set()
        self._running = False
        self._collected = False
        self._files: StepFiles | None = None
        self._incomplete = False
        self._discarded: list[StepFiles] = []
        self._closed = False
        exit_guard.guard(self)

    # ---- the predecessor's calls ---------------------------------------------------------
    def start(self, model: Any = None) -> None:
        """Start (or resume) collecting; the first call validates against the run and installs hooks."""
        model = model if model is not None else self._model
        if self._recorder is None:
            self._setup(model)
        elif model is not None and id(model) not in self._hooked:
            self._hook_model(model)
        self._running = True
        self._activate()

    def stop(self) -> None:
        """Stop collecting (what this step collected is written at `step()`)."""
        self._running = False
        self._deactivate()

    def step(self) -> None:
        """Close the step: its dump is handed to the writer; counters restart."""
        with exit_guard.critical():  # a signal raises after the step is handed over, not inside
            running = self._running
            self._deactivate()
            if self._recorder is not None:
                self._commit()
            self.current_step += 1
            self._running = running
            self._activate()

    def close(self) -> None:
        """Write a step still open, wait for the writer and remove every hook. A second call
        does nothing; the process's end calls it for a session not closed (`exit_guard`)."""
        if self._closed:
            return
        self.stop()
        if self._collected:
            self._commit()
        for hooks in self._hooks:
            hooks.remove()
        self._hooks.clear()
        self.writer.close()
        for files in self._discarded:  # tensor files of dropped steps (hidden .partial directories)
            files.discard()
        self._discarded.clear()
        self._closed = True
        if self.dropped_steps:
            reasons = "; ".join(f"{count}: {reason}" for reason, count in self.drop_reasons.items())
            log.warning("msprobe dump: %d of %d step(s) dropped (%s)", self.dropped_steps,
                        self.dropped_steps + self.steps_written, reasons)

    def flush(self) -> None:
        """Wait until everything handed to the writer is on disk."""
        self.writer.flush()

    @contextlib.contextmanager
    def step_scope(self, model: Any = None) -> Iterator["DumpSession"]:
        """``start(model)`` ... ``stop(); step()`` around one training step."""
        self.start(model)
        try:
            yield self
        finally:
            self.stop()
            self.step()

    def __enter__(self) -> "DumpSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- for layers over the session (msprobe_engine.compat): set-up without starting --------
    def prepare(self, model: Any = None) -> None:
        """Validate the config against the run and create the recorder (what the first `start`
        does), without collecting; `rank` is known after it."""
        if self._recorder is None:
            self._setup(model)

    def add_hooks(self, hooks: Any) -> None:
        """Hooks (anything with ``remove()``) that `close` removes with the session's own."""
        self._hooks.append(hooks)

    @property
    def recorder(self) -> Any:
        """The task's recorder once set up (`prepare` or `start`), else None."""
        return self._recorder

    @property
    def api_mode(self) -> Any:
        """The API interception the session pushes while it collects (None without one)."""
        return self._mode

    @property
    def transfers(self) -> int:
        """Device-to-host copies of statistics so far (one per dumped step)."""
        return self._recorder.transfers if self._recorder is not None else 0

    @property
    def hook_errors(self) -> dict[str, int]:
        """Errors inside the dump's hooks so far, by hook (logged once each; strict mode raises)."""
        return self._recorder.hook_errors if self._recorder is not None else {}

    # ---- the framework layer (a framework's session implements these) -------------------
    def _setup(self, model: Any) -> None:
        """Validate the config against the run and `model`, create the recorder, hook `model`."""
        raise NotImplementedError

    def _hook_model(self, model: Any) -> None:
        """Install the dump's hooks on another model."""
        raise NotImplementedError

    def _activate(self) -> None:
        """Start recording when this step and rank are dumped (API interception on)."""
        raise NotImplementedError

    def _deactivate(self) -> None:
        raise NotImplementedError

    # ---- writing -----------------------------------------------------------------------
    def _step_files(self) -> StepFiles:
        if self._files is None:
            self._files = StepFiles(self.config.dump_path, self.current_step, self.rank,
                                    legacy=self.config.predecessor_format == "1.x")
        return self._files

    def _emit_tensors(self, items: list) -> None:
        """Called by the recorder with tensor copies to save and/or checksum on the writer thread."""
        if self._incomplete:
            return
        save, checksum = self._tensor_writers()
        job = partial(self._step_files().write_tensors, items, save, checksum)
        if not self.writer.submit(job, "dump tensors"):
            self._incomplete = True

    def _tensor_writers(self) -> tuple[Any, Any]:
        """(save a tensor copy to a path, or None; its checksum, or None) as the config asks."""
        raise NotImplementedError

    def _commit(self) -> None:
        try:
            data = self._recorder.finish_step()
        except Exception:
            if self.config.strict:
                raise
            log.exception("msprobe dump: step %d could not be closed", self.current_step)
            data = None
        if self._collected and (data is None or data.entries or data.write_empty):
            files = self._step_files()
            if data is None or self._incomplete:
                self._drop(files, "its tensors did not fit in the writer queue" if data else "an error")
            else:
                meta = {"task": self.config.task, "level": self.config.level, "framework": self.framework,
                        "dump_data_dir": None}
                # the step's last job waits for room whatever the policy: dropping it would lose
                # a step whose tensor jobs are all queued (and, at close, the run's last step)
                self.writer.submit(partial(self._write_step, files, meta, data, self.current_step), "dump step",
                                   wait=True)
        self._files, self._incomplete, self._collected = None, False, False

    def _drop(self, files: StepFiles, reason: str, step: int | None = None, detail: str = "") -> None:
        """Count a dropped step (training or writer thread); its files go at `close()`, or now
        when `step` is given (on the writer thread, after the step's last write)."""
        with self._drop_lock:
            self.dropped_steps += 1
            self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1
            first = self.dropped_steps == 1
        if step is None:
            self._discarded.append(files)
        else:
            files.discard()
        if first:
            log.warning("msprobe dump: step %d dropped: %s%s (further drops are counted)",
                        self.current_step if step is None else step, reason, f" ({detail})" if detail else "")

    def _write_step(self, files: StepFiles, meta: dict, data: Any, step: int) -> None:
        """Commit one step's directory (writer thread); a file not written whole drops the step."""
        try:
            files.commit(meta, data.entries, data.host_rows, data.construct, data.stacks, data.extra)
        except (OSError, StepIncomplete) as exc:  # a full disk, a file-size limit: dropped, never half there
            self._drop(files, "a file could not be written whole", step, f"{type(exc).__name__}: {exc}"[:300])
            return
        except Exception:  # a bug: dropped too, and reported by the writer (raised in strict mode)
            self._drop(files, "an error while writing it", step)
            raise
        self.steps_written += 1


def check_names(config: DumpConfig, modules: dict[str, Any], catalog: Any) -> None:
    """Full names in scope/list must name a module of the model or an API this dump records."""
    named = [(f"scope[{i}]", n) for i, n in enumerate(config.scope or ())]
    named += [(f"list[{i}]", n) for i, n in enumerate(config.api_list) if parse_entry_name(n) is not None]
    for where, name in named:
        entry = parse_entry_name(name)
        key = f"{entry.prefix}.{entry.target}"
        if entry.is_module:
            if config.level == "L1":
                raise ConfigError(f"{where}: {name!r} names a module but level is L1 (APIs only)")
            if key not in modules:
                near = [k for k in modules if k.endswith(f".{entry.target.rsplit('.', 1)[-1]}")][:3]
                hint = f"; modules of that class: {', '.join(near)}" if near else ""
                raise ConfigError(f"{where}: {name!r}: the model has no module {key}{hint}")
        elif config.level == "L0":
            raise ConfigError(f"{where}: {name!r} names an API but level is L0 (modules only)")
        elif not catalog.has_key(key):
            raise ConfigError(f"{where}: {name!r}: {key} is not an API this dump records "
                              f"(Torch., Tensor., Functional. or Distributed. followed by its name)")
