"""Live control of a running monitor: a JSON file the user edits while training.

The file (default ``<output_dir>/control.json``, config `control.file`) may hold any of::

    {
      "schedule": {"start_step": 0, "end_step": null, "interval": 10},
      "rules": {"spike": false, "trend": true},
      "watch": {"module_outputs": false, "param_grads": true}
    }

`schedule` replaces the config's schedule; `rules` switches configured rules (by name) off
and on again; `watch` switches kinds of tensors that were watched at attach off (and on
again). A key that is absent means the config's own setting, so removing the file returns
to the config. The file is read on the writer thread at most once every `control.interval_s`
seconds; when its text changed, what it says takes effect at the next step boundary.
A file that cannot be used is reported once (with every problem, as config errors are)
and ignored: the settings in effect stay.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from msprobe_engine.config.loader import ConfigErrors, build_section, problems
from msprobe_engine.config.schema import MonitorConfig, Schedule, Watch
from msprobe_engine.errors import ConfigError
from msprobe_engine.sinks import BackgroundWriter

if TYPE_CHECKING:
    from msprobe_engine.stats.table import MetricKey

log = logging.getLogger("msprobe_engine")

CONTROL_NAME = "control.json"
#: a control file larger than this is refused
MAX_BYTES = 1 << 20
#: `watch` key of the control file -> the kind of rows it mutes
WATCH_KINDS = {"module_outputs": "actv", "activation_grads": "actv_grad", "param_grads": "grad",
               "params": "param", "optimizer_state": "optim"}


class Control:
    """What a control file says, validated against the monitor it controls: the schedule
    (None: the config's), the rules switched off, the kinds of rows muted."""

    def __init__(self, schedule: Schedule | None = None, rules_off: frozenset[str] = frozenset(),
                 muted: frozenset[str] = frozenset()) -> None:
        self.schedule = schedule
        self.rules_off = rules_off
        self.muted = muted

    @classmethod
    def parse(cls, data: Any, rule_names: Sequence[str], watched_kinds: set[str]) -> "Control":
        """Validate the file's contents; a `ConfigError` lists every problem."""
        if not isinstance(data, dict):
            raise ConfigError(f"expected a JSON object, got {type(data).__name__}")
        errors: list[str] = []
        for key in data:
            if key not in ("schedule", "rules", "watch"):
                errors.append(f"{str(key)[:80]}: unknown key; allowed: schedule, rules, watch")
        schedule = None
        if "schedule" in data:
            try:
                schedule = build_section(Schedule, data["schedule"], "schedule")
            except ConfigError as exc:
                errors += problems(exc)
        rules_off = _switches(data.get("rules", {}), "rules", set(rule_names), errors)
        watch = data.get("watch", {})
        off = _switches(watch, "watch", set(WATCH_KINDS), errors)
        for key, on in watch.items() if isinstance(watch, dict) else ():
            if on is True and key in WATCH_KINDS and WATCH_KINDS[key] not in watched_kinds:
                errors.append(f"watch.{key}: not watched since attach; only the config can switch it on")
        if errors:
            raise ConfigErrors(errors)
        return cls(schedule, frozenset(rules_off), frozenset(WATCH_KINDS[key] for key in off))


def watched_kinds(watch: Watch) -> set[str]:
    """The kinds of rows the config's `watch` section measures."""
    on = {"module_outputs": watch.module_outputs or watch.module_inputs, "activation_grads": watch.activation_grads,
          "param_grads": watch.param_grads, "params": watch.params, "optimizer_state": bool(watch.optimizer_state)}
    return {WATCH_KINDS[key] for key, value in on.items() if value}


def _switches(value: Any, section: str, allowed: set[str], errors: list[str]) -> set[str]:
    """The names switched off (false) in a {name: bool} section; problems go to `errors`."""
    if not isinstance(value, dict):
        errors.append(f"{section}: expected an object of name: true/false, got {type(value).__name__}")
        return set()
    off = set()
    for name, on in value.items():
        if name not in allowed:
            errors.append(f"{section}.{str(name)[:80]}: not one of {', '.join(sorted(allowed))}")
        elif not isinstance(on, bool):
            errors.append(f"{section}.{name}: expected true or false, got {str(on)[:80]!r}")
        elif not on:
            off.add(name)
    return off


def read_control_text(path: Path) -> str | None:
    """The text of the control file, None when there is none. Only a regular file is read
    (a FIFO, a device such as /dev/zero behind a link, a directory: an OSError), opened
    without blocking and read to at most `MAX_BYTES` (more: an OSError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        chunks, size = [], 0
        while size <= MAX_BYTES:
            chunk = os.read(fd, MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_BYTES:
            raise OSError(f"{path}: larger than {MAX_BYTES} bytes")
        return b"".join(chunks).decode("utf-8")
    finally:
        os.close(fd)


class ControlFile:
    """Polls a control file for one monitor (`poll` at every step boundary). `rule_names`: the
    monitor's rules (the file may switch them off and on)."""

    def __init__(self, path: Path, interval_s: float, rule_names: Sequence[str], schedule: Schedule,
                 watch: Watch) -> None:
        self.path = path
        self.interval_s = interval_s
        self.rule_names = list(rule_names)
        self.configured_schedule = schedule
        self.watched = watched_kinds(watch)
        self.current = Control()
        self._last_poll = time.monotonic()
        self._seen: tuple[str, str | None] = ("ok", None)  # the last read: its text (None: no file) or error
        self._reading = False
        self._read: Any = None              # what the writer thread read: ("ok", data) | ("error", msg)

    @classmethod
    def of(cls, config: MonitorConfig, rule_names: Sequence[str]) -> "ControlFile | None":
        """The control file of a monitor with `config` (None: `control.enabled` is false)."""
        control = config.control
        if not control.enabled:
            return None
        path = Path(control.file or Path(config.output_dir) / CONTROL_NAME)
        return cls(path, control.interval_s, rule_names, config.schedule, config.watch)

    def poll(self, writer: BackgroundWriter, step: int) -> Control | None:
        """At a step boundary (`step` begins): what the writer thread read since, when it is a
        valid control (the monitor applies it: `Control.schedule`, `Control.rules_off`); every
        `interval_s`, ask `writer` to look at the file again. Costs one clock read otherwise."""
        control = None
        if self._read is not None:
            read, self._read = self._read, None
            control = self._parse(read, step)
        if self._reading or time.monotonic() - self._last_poll < self.interval_s:
            return control
        self._last_poll = time.monotonic()
        self._reading = True
        if not writer.submit(self._look, "control file read"):
            self._reading = False
        return control

    def _look(self) -> None:
        """Writer thread: read the file; keep what it says when it differs from the last read
        (a file that went away says {}: back to the config)."""
        try:
            try:
                seen = ("ok", read_control_text(self.path))
            except (OSError, UnicodeDecodeError) as exc:  # reported once, until the file or the error changes
                seen = ("error", f"cannot read: {str(exc)[:200]}")
            if seen == self._seen:
                return
            self._seen = seen
            status, text = seen
            self._read = seen if status == "error" else ("ok", {} if text is None else json.loads(text))
        except (ValueError, RecursionError) as exc:
            self._read = ("error", f"cannot read: {str(exc)[:200]}")
        finally:
            self._reading = False

    def _parse(self, read: tuple[str, Any], step: int) -> Control | None:
        """The control the file says (its schedule: the config's where it has none), or None
        (reported) when it cannot be used."""
        status, data = read
        try:
            if status == "error":
                raise ConfigError(data)
            control = Control.parse(data, self.rule_names, self.watched)
        except ConfigError as exc:
            for message in problems(exc):
                log.warning("msprobe control: %s: %s; the file is ignored", self.path, message)
            return None
        self.current = control
        schedule = control.schedule or self.configured_schedule
        log.warning("msprobe control: %s applied from step %d: schedule %s; rules off: %s; muted: %s", self.path,
                    step, schedule, ", ".join(sorted(control.rules_off)) or "none",
                    ", ".join(sorted(control.muted)) or "none")
        return Control(schedule, control.rules_off, control.muted)

    def unmuted(self, keys: Sequence["MetricKey"], tensors: Sequence[Any], same: Sequence[Any],
                measured: dict) -> tuple[list, list, list]:
        """`keys`, `tensors` and `same` without the muted kinds' rows; a `same` entry that named
        a muted row (never measured) becomes None (measure the tensor itself). `measured`: the
        monitor's rows given `same` earlier in the step."""
        keep = [i for i, key in enumerate(keys) if key.kind not in self.current.muted]
        keys = [keys[i] for i in keep]
        tensors = [tensors[i] for i in keep]
        if same:
            own = {key for key, i in zip(keys, keep) if same[i] is None}
            same = [same[i] if same[i] is None or same[i] in own or same[i] in measured else None for i in keep]
        return keys, tensors, list(same)
