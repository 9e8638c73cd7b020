"""Files of one dumped (step, rank), written on the writer thread and committed atomically.

Everything of ``step{N}/rank{R}/`` (tensor files, dump.json, stack.json, construct.json) is
first written into the hidden directory ``step{N}/.rank{R}.partial/`` and then renamed into
place: a crash at any moment leaves either a complete rank directory or none (the reader
ignores ``.partial`` directories). The rename happens only when every file the step's
dump.json lists was written whole (a JSON file: its size on disk is what was written; a tensor
file: its saver returned without an error and the file was on disk right after); a write that failed
(full disk, file-size limit) makes `commit` raise `StepIncomplete`, and the session drops the
step and removes its ``.partial`` directory. Files are not synced (no ``fsync``): a process that
dies leaves what it wrote in the page cache, which the kernel writes back; syncing would make
the writer wait for the disk on every step (the tensor files' data included, on ext4) and
protects only against a power loss. A single-process run writes ``proc<pid>/`` as the predecessor
(mindstudio-probe 26.2) does, or ``rank/`` with its 1.x spelling (``predecessor_format: "1.x"``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import linecache
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import orjson

from msprobe_engine.dump.entry import TensorSlot, rendered_entries
from msprobe_engine.dump.reader import CONSTRUCT_JSON, DUMP_JSON, STACK_JSON, TENSOR_DIR
from msprobe_engine.dump.schema import iter_dump_tensors
from msprobe_engine.dump.task import DUMP_TASKS
from msprobe_engine.json_text import json_special

#: a raw call stack: (file, line, function) per frame, innermost last
Frames = Sequence[tuple[str, int, str]]


class StackNode:
    """A call stack as a chain shared between the calls made from the same frames: `frame`
    (``(file, line, function)``) and the `caller` chain (None: the outermost frame). Built on
    the training thread in O(the frames that changed); `as_frames` lists it on the writer thread."""
    __slots__ = ("frame", "caller")

    def __init__(self, frame: tuple[str, int, str], caller: "StackNode | None") -> None:
        self.frame, self.caller = frame, caller


def as_frames(stack: "Frames | StackNode | None") -> tuple[tuple[str, int, str], ...]:
    """The frames of `stack`, innermost first (a `StackNode` chain or a list of frames)."""
    if not isinstance(stack, StackNode) and stack is not None:
        return tuple(stack)
    frames = []
    while stack is not None:
        frames.append(stack.frame)
        stack = stack.caller
    return tuple(frames)


@dataclass
class StepData:
    """Everything one step leaves for the writer thread (any framework's recorder)."""
    entries: dict[str, Any]
    construct: dict[str, str | None]
    stacks: dict[str, Frames | StackNode] | None
    host_rows: np.ndarray
    #: False: a step without entries writes no files (overflow_check, diff_check, free_benchmark)
    write_empty: bool = True
    #: more JSON files of the rank directory: file name -> content (overflow_summary.json)
    extra: dict[str, Any] | None = None


def rank_dir_name(rank: int | None, legacy: bool = False) -> str:
    """``rank3`` in a distributed run; in a single process ``proc<pid>`` (the predecessor's
    layout), or ``rank`` with `legacy` (its 1.x layout)."""
    if rank is not None:
        return f"rank{rank}"
    return "rank" if legacy else f"proc{os.getpid()}"


def dump_json_text(meta: dict[str, Any], data: dict[str, Any] | Iterable[tuple[str, Any]]) -> bytes:
    """dump.json (UTF-8): the top-level keys, then one line per entry (C-encoded by orjson; NaN and
    Infinity as in the reference where `data` holds them as `json_special` fragments). `data`: the
    entries, or (name, entry) pairs (each encoded as it comes)."""
    dumps = orjson.dumps
    head = b"".join(b" %s: %s,\n" % (dumps(key), dumps(value)) for key, value in meta.items())
    pairs = data.items() if isinstance(data, dict) else data
    body = b",\n".join(b"  %s: %s" % (dumps(name), dumps(entry)) for name, entry in pairs)
    return b"{\n" + head + b' "data": {\n' + body + (b"\n" if body else b"") + b" }\n}\n"


def json_document(value: Any) -> bytes:
    """A JSON file of plain values (stack.json, construct.json), indented, C-encoded."""
    return orjson.dumps(value, option=orjson.OPT_INDENT_2) + b"\n"


def format_stack(frames: Frames) -> list[str]:
    """Frames as the predecessor writes them: ``File <path>, line <n>, in <func>, \\n <code>``
    (each frame's text made once per process, `MAX_FRAME_TEXTS` at most kept)."""
    texts = _frame_texts
    listed = []
    for frame in frames:
        text = texts.get(frame)
        if text is None:
            if len(texts) >= MAX_FRAME_TEXTS:
                texts.clear()
            file, line, func = frame
            text = texts[frame] = f"File {file}, line {line}, in {func}, \n {linecache.getline(file, line).strip()}"
        listed.append(text)
    return listed


#: most frame texts `format_stack` keeps
MAX_FRAME_TEXTS = 1 << 16
_frame_texts: dict[tuple[str, int, str], str] = {}


def stack_document(stacks: dict[str, Frames | StackNode], legacy: bool = False) -> dict[str, Any]:
    """stack.json: ``{"0": [[names...], [frames...]], ...}``, the entries of one call stack grouped
    (mindstudio-probe 26.2), or ``{name: [frames...]}`` (`legacy`, its 1.x form)."""
    listed: dict[int, tuple] = {}  # a chain shared by many entries is listed once
    for stack in stacks.values():
        if id(stack) not in listed:
            listed[id(stack)] = as_frames(stack)
    stacks = {name: listed[id(stack)] for name, stack in stacks.items()}
    if legacy:
        return {name: format_stack(frames) for name, frames in stacks.items()}
    groups: dict[tuple, list[str]] = {}
    for name, frames in stacks.items():
        groups.setdefault(frames, []).append(name)
    return {str(i): [names, format_stack(frames)] for i, (frames, names) in enumerate(groups.items())}


def array_crc32(array: np.ndarray) -> str:
    """The predecessor's "md5" value of a host copy: CRC-32 of its bytes, 8 hex digits."""
    return f"{zlib.crc32(np.ascontiguousarray(array)):08x}"


class StepIncomplete(Exception):
    """A file of the step could not be written whole; the message says which and why."""


def write_file(path: Path, text: str | bytes) -> None:
    """Write `text` (bytes: as they are); raise `StepIncomplete` when the file on disk is shorter.
    Not synced (see the module docstring)."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    with open(path, "wb") as f:
        f.write(data)
    _check_size(path, len(data))


def save_whole(save: Callable[[Any, str], None], value: Any, path: str) -> int:
    """`save(value, path)` into a new file; its size on disk (read once, right after the write).
    The saver opens the file itself (torch.save's C++ writer: no Python file object copying every
    record) and raises when a write falls short (full disk, file-size limit)."""
    save(value, path)
    return os.stat(path).st_size


def _check_size(path: Path, size: int) -> None:
    on_disk = os.stat(path).st_size
    if on_disk != size:
        raise StepIncomplete(f"{path.name}: {on_disk} of {size} bytes on disk")


log = logging.getLogger("msprobe_engine")
#: (dump path, partial directory name) already swept by this process
_swept: set[tuple[str, str]] = set()


def sweep_partials(dump_path: Path, partial_name: str) -> None:
    """Once per process and dump path: remove the `step*/<partial_name>` directories that an
    earlier run of this rank left when it crashed mid-step, logging how many and how large."""
    key = (str(Path(dump_path).resolve()), partial_name)
    if key in _swept:
        return
    _swept.add(key)
    stale = [p for p in Path(dump_path).glob("step*/.*.partial") if p.is_dir() and _stale(p.name, partial_name)]
    if not stale:
        return
    size = sum(f.stat().st_size for p in stale for f in p.rglob("*") if f.is_file())
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    log.warning("msprobe dump: removed %d unfinished step director%s (%s, %.1f MB) left in %s by an earlier run "
                "that stopped mid-step", len(stale), "y" if len(stale) == 1 else "ies", partial_name,
                size / 1e6, dump_path)


def _stale(name: str, partial_name: str) -> bool:
    """A partial directory left by an earlier run of this rank: one of this rank's own name, or,
    in a single process, one of a process that is gone (``.proc<pid>.partial``)."""
    if name == partial_name:
        return True
    pid = re.fullmatch(r"\.proc(\d+)\.partial", name)
    return pid is not None and partial_name.startswith(".proc") and not _alive(int(pid.group(1)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


class StepFiles:
    """The directory of one (step, rank). Every method runs on the writer thread."""

    def __init__(self, dump_path: Path, step: int, rank: int | None, legacy: bool = False) -> None:
        step_dir = Path(dump_path) / f"step{step}"
        name = rank_dir_name(rank, legacy)
        self.final = step_dir / name
        self.legacy = legacy
        self.partial = step_dir / f".{name}.partial"
        self._ready = False
        #: why a tensor file could not be written (the step is then dropped at `commit`)
        self.failure: str | None = None
        #: tensor files written so far: data_name -> bytes
        self.sizes: dict[str, int] = {}
        self._tensor_dir: str | None = None  # tensor_dir as a string, once made

    @property
    def tensor_dir(self) -> Path:
        return self.partial / TENSOR_DIR

    def _prepare(self) -> None:
        if not self._ready:
            sweep_partials(self.final.parent.parent, self.partial.name)
            shutil.rmtree(self.partial, ignore_errors=True)  # left by a crashed run
            self.partial.mkdir(parents=True)
            self._ready = True

    def write_tensors(self, items: Sequence[tuple[TensorSlot, Any]], save: Callable[[Any, Any], None] | None,
                      checksum: Callable[[Any], str] | None) -> None:
        """Save tensor copies under their data_name (`save(tensor, path)`) and/or set their slots'
        CRC-32. After a failed write the step's other tensors are not saved (it is dropped)."""
        if self.failure is not None:
            return
        try:
            self._prepare()
            if save is not None and self._tensor_dir is None:
                self.tensor_dir.mkdir(exist_ok=True)
                self._tensor_dir = str(self.tensor_dir)
            for slot, tensor in items:
                if save is not None and slot.data_name is not None:
                    path = os.path.join(self._tensor_dir, slot.data_name)
                    self.sizes[slot.data_name] = save_whole(save, tensor, path)
                if checksum is not None:
                    slot.md5 = checksum(tensor)
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"[:300]

    def commit(self, meta: dict[str, Any], entries: dict[str, Any], host_rows: np.ndarray,
               construct: dict[str, str | None] | None, stacks: dict[str, Frames] | None,
               extra: dict[str, Any] | None = None) -> Path:
        """Write the JSON files (and `extra`: file name -> content) and move the directory into
        place; returns the rank directory. Raises `StepIncomplete` (or the write's OSError) when a
        file it lists is missing or short."""
        if self.failure is not None:
            raise StepIncomplete(self.failure)
        self._prepare()
        data = rendered_entries(entries, host_rows, meta.get("framework", "pytorch"), json_special)
        if _saves_tensors(meta.get("task")):
            meta = {**meta, "dump_data_dir": str((self.final / TENSOR_DIR).resolve())}
            data = self._checked(data)
        write_file(self.partial / DUMP_JSON, dump_json_text(meta, data))
        if stacks is not None:
            write_file(self.partial / STACK_JSON, json_document(stack_document(stacks, self.legacy)))
        if construct is not None:
            write_file(self.partial / CONSTRUCT_JSON, json_document(construct))
        for name, content in (extra or {}).items():
            write_file(self.partial / name, json.dumps(content, indent=1))
        if self.final.exists():
            shutil.rmtree(self.final)  # the same step of an earlier run into the same dump_path
        os.replace(self.partial, self.final)
        return self.final

    def _checked(self, data: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """`data`'s entries as they come, each data_name of them checked to be a file written whole:
        saved without an error and found on disk right after (`sizes`; its size is not read a second time)."""
        for name, entry in data:
            for ref in iter_dump_tensors({"data": {name: entry}}):
                data_name = ref.record.get("data_name")
                if data_name is not None and data_name not in self.sizes:
                    raise StepIncomplete(f"{ref.entry} {ref.label}: {data_name} was not written")
            yield name, entry

    def discard(self) -> None:
        """Remove the files of a dropped step (on the writer thread, or after it stopped), and
        its ``step{N}`` directory when nothing else is in it."""
        shutil.rmtree(self.partial, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.partial.parent.rmdir()


def _saves_tensors(task: Any) -> bool:
    """Whether the registered dump task `task` writes tensor files (its `saves_tensors`)."""
    return isinstance(task, str) and task in DUMP_TASKS and DUMP_TASKS.get(task).saves_tensors
