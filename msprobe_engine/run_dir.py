"""Where a run writes: ``<output_dir>/<run name>/rank<R>/``, so that runs never mix.

The run name is `run_name` from the config, else ``$MSPROBE_RUN_NAME``, else a timestamp
(``20261201-091500``). A multi-process job needs one name on every rank: without a given
name its ranks take the start time of the process that launched them (torchrun, the
DeepSpeed launcher, ``mp.spawn``: the same parent on one node); on several nodes, give
`run_name`. A rank directory that already holds a run (steps recorded) is refused (`ConfigError`) unless
`resume: true`, which continues the run: the monitor state saved there at `close` is
loaded (`Monitor.load_state_dict`), so its steps go on where they stopped; without a saved
state (the process was killed before `close`) the steps go on after the last one recorded
in the run's own `metrics.jsonl` or `metrics.csv`, and a run with neither is refused.
`resume: true` without a name continues the most recent run of `output_dir`. The name
``.`` writes straight into `output_dir` (``<output_dir>/rank<R>/``).

A writing monitor holds an exclusive lock on ``<rank dir>/.lock`` (`fcntl.flock`, with its
pid in the file) from construction to `close`: a second monitor on the same rank
directory, in this process or another, is refused with the holder's pid.
"""
from __future__ import annotations

import csv
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None  # type: ignore[assignment]

from msprobe_engine.errors import ConfigError
from msprobe_engine.incident.environment import ENVIRONMENT_FILE

RUN_NAME_ENV = "MSPROBE_RUN_NAME"
STATE_FILE = "monitor_state.json"
LOCK_FILE = ".lock"
#: the record files a resume without a saved state reads its last step from, in this order
RECORD_FILES = ("metrics.jsonl", "metrics.csv")
EVENT_FILE_PREFIX = "events.out.tfevents."
TIME_FORMAT = "%Y%m%d-%H%M%S"


@dataclass(frozen=True, slots=True)
class RunDir:
    """One rank's directories of one run."""
    root: Path  # <output_dir>/<run name>
    rank_dir: Path  # root/rank<R>: the sinks' files and the saved monitor state
    resumed: bool  # the rank directory held an earlier part of this run
    incidents: Path  # the configured `incidents.dir`, by default root/incidents
    lock: "RunLock | None" = None  # held while this monitor writes here

    @property
    def name(self) -> str:
        return self.root.name

    def release(self) -> None:
        """Give up the rank directory's lock (at `close`)."""
        if self.lock is not None:
            self.lock.release()

    def next_step_from_records(self) -> int:
        """The step after the last one the run's records hold, for a resume without a saved
        state; a `ConfigError` saying why when no record file tells."""
        for name in RECORD_FILES:
            file = self.rank_dir / name
            if file.is_file():
                step = _last_step(file)
                if step is not None:
                    return step + 1
        raise ConfigError(f"resume: {self.rank_dir} has no {STATE_FILE} (the run stopped before close()) and no "
                          f"step in {' or '.join(RECORD_FILES)} to continue after; start another run_name, or "
                          "give the step to start at (Monitor(start_step=...))")

    def saved_state(self) -> dict[str, Any] | None:
        """The monitor state saved by the run's previous part (None when there is none)."""
        file = self.rank_dir / STATE_FILE
        if not (self.resumed and file.is_file()):
            return None
        try:
            return json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise ConfigError(f"resume: cannot read the saved monitor state {file}: {exc}") from None

    def save_state(self, state: dict[str, Any]) -> None:
        """Write `state` for a later `resume: true` (writer thread; atomic)."""
        file = self.rank_dir / STATE_FILE
        partial = file.with_suffix(".tmp")
        partial.write_text(json.dumps(state), encoding="utf-8")
        partial.replace(file)


def open_run_dir(output_dir: str, run_name: str, resume: bool, rank: int, writes: bool,
                 incidents_dir: str = "") -> RunDir:
    """The run directory of this rank; a rank that `writes` gets its directory created and
    checked (refused when it holds a run and `resume` is false). `incidents_dir`: the
    configured incidents directory (empty: the run's own ``incidents/``)."""
    base = Path(output_dir)
    given = run_name or os.environ.get(RUN_NAME_ENV, "")
    if given:
        _check_name(given)
        root = base if given == "." else base / given
    elif resume:
        root = _latest_run(base, rank) or base / _timestamp_name(base, rank)
    else:
        root = base / _timestamp_name(base, rank)
    rank_dir = root / f"rank{rank}"
    lock = None
    if writes:
        _prepare(rank_dir)
        lock = RunLock(rank_dir)
    holds_data = rank_dir.is_dir() and _holds_run(rank_dir)
    if writes and holds_data and not resume:
        lock.release()
        raise ConfigError(f"run_name: {rank_dir} already holds a run ({', '.join(_some_files(rank_dir))}); "
                          "choose another run_name, or set resume: true to continue that run")
    return RunDir(root, rank_dir, resume and holds_data, Path(incidents_dir) if incidents_dir else root / "incidents",
                  lock)


class RunLock:
    """An exclusive `flock` on ``<rank dir>/.lock`` holding this process's pid; a second
    taker (another process, or another monitor of this one) gets a `ConfigError` with the
    holder's pid. Released by `release`, or by the process's end."""

    def __init__(self, rank_dir: Path) -> None:
        self.path = rank_dir / LOCK_FILE
        self._file: IO[str] | None = None
        if fcntl is None:
            return
        try:
            file = open(self.path, "a+", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"output_dir: cannot create the lock {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            file.seek(0)
            holder = file.read(32).strip() or "unknown"
            file.close()
            raise ConfigError(f"run_name: {rank_dir} is being written by another monitor (pid {holder}, holding "
                              f"{self.path}); close it first, or choose another run_name") from None
        file.seek(0)
        file.truncate()
        file.write(f"{os.getpid()}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.truncate(0)
            self._file.close()  # closing the descriptor drops the flock


def _last_step(file: Path, block: int = 1 << 16) -> int | None:
    """The step of the last whole record of a metrics.jsonl / metrics.csv (None: none)."""
    with open(file, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - block))
        lines = f.read().splitlines()
    for raw in reversed(lines[1:] if size > block else lines):  # the first may be cut by the block start
        try:
            text = raw.decode("utf-8")
            step = json.loads(text)["step"] if file.suffix == ".jsonl" else int(next(csv.reader([text]))[0])
        except (ValueError, KeyError, TypeError, IndexError, StopIteration):
            continue  # a torn line, the CSV header
        if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2 ** 53:
            return step
    return None


def _holds_run(rank_dir: Path) -> bool:
    """Whether a monitor recorded steps here: its saved state says so, or (after a crash) a
    file holds more than what a monitor without steps leaves (empty files, an event file
    with only its version record)."""
    state = rank_dir / STATE_FILE
    if state.is_file():
        try:
            written = json.loads(state.read_text(encoding="utf-8")).get("records_written", 1)
        except (OSError, ValueError, AttributeError, TypeError, RecursionError):
            return True
        return written != 0 or isinstance(written, bool)  # a count other than 0 (even a malformed one): a run
    for file in rank_dir.iterdir():
        if file.name in (LOCK_FILE, ENVIRONMENT_FILE):  # the lock; environment.json, written at start
            continue
        if file.name.startswith(EVENT_FILE_PREFIX) and file.is_file():
            if _records_beyond_the_first(file):
                return True
        elif not file.is_file() or file.stat().st_size > 0:
            return True
    return False


def _records_beyond_the_first(event_file: Path) -> bool:
    """A TFRecord file (u64 length, u32 crc, data, u32 crc per record) longer than one record."""
    with open(event_file, "rb") as f:
        header = f.read(8)
        if len(header) < 8:
            return False
        first = 8 + 4 + int.from_bytes(header, "little") + 4
        f.seek(0, os.SEEK_END)
        return f.tell() > first


def _check_name(name: str) -> None:
    if name != "." and (name in ("..", "") or "/" in name or "\\" in name):
        raise ConfigError(f"run_name: {name!r} must be a plain directory name (no '/'), or '.'")


def _timestamp_name(base: Path, rank: int) -> str:
    """The launch time: this process's, or in a multi-process job its launcher's. A single
    process that finds the name taken (two runs in one second) adds -2, -3, ..."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return time.strftime(TIME_FORMAT, time.localtime(_parent_start_time()))
    name = stem = time.strftime(TIME_FORMAT)
    suffix = 1
    while (base / name / f"rank{rank}").exists():
        suffix += 1
        name = f"{stem}-{suffix}"
    return name


def _parent_start_time() -> float:
    """When the parent process started (Linux /proc), else now."""
    try:
        fields = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, in clock ticks since boot
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return time.time()


def _latest_run(base: Path, rank: int) -> Path | None:
    """The run of `base` whose rank directory changed last."""
    runs = [d for d in base.glob(f"*/rank{rank}") if d.is_dir()] if base.is_dir() else []
    return max(runs, key=lambda d: d.stat().st_mtime).parent if runs else None


def _some_files(directory: Path, limit: int = 3) -> list[str]:
    names = sorted(p.name for p in directory.iterdir() if p.name != LOCK_FILE)
    return names[:limit] + (["..."] if len(names) > limit else [])


def _prepare(rank_dir: Path) -> None:
    """Create `rank_dir` and write a probe file in it, or raise `ConfigError` naming the path and
    the reason (before training): a file in the way, no permission, a read-only file system."""
    blocking = next((p for p in [rank_dir, *rank_dir.parents] if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"output_dir: cannot create {rank_dir}: {blocking} is a file, not a directory")
    probe = rank_dir / f".msprobe-write-test-{os.getpid()}"
    try:
        rank_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        where = exc.filename or rank_dir
        raise ConfigError(f"output_dir: cannot write in {rank_dir}: {where}: {exc.strerror or exc}") from None
