"""Load dump directories: ``dump_path/step{N}/<rank dir>/{dump.json, stack.json, construct.json, dump_tensor_data/}``.

A rank directory is ``rank<R>`` (a distributed run), ``proc<pid>`` (a single process, as
mindstudio-probe 26.2 writes it) or ``rank`` (a single process, its 1.x layout); every reader
takes all three.

Tensors are loaded one at a time on request: ``.pt`` through ``torch.load(weights_only=True)``
(torch imported only then), ``.npy`` with ``allow_pickle=False``. ``RankDump.load_tensor`` gives a
numpy array in memory; ``RankDump.open_tensor`` (used by compare) maps the file instead
(``torch.load(mmap=True)``, ``np.load(mmap_mode="r")``) and keeps torch tensors as they are.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from msprobe_engine.dump.schema import TensorRef, validate_dump_json, validate_entry
from msprobe_engine.errors import read_utf8
from msprobe_engine.registry import framework_where, load_framework

DUMP_JSON = "dump.json"
STACK_JSON = "stack.json"
CONSTRUCT_JSON = "construct.json"
TENSOR_DIR = "dump_tensor_data"
_STEP_RE = re.compile(r"^step(\d+)$")
_RANK_RE = re.compile(r"^rank(\d*)$")
_PROC_RE = re.compile(r"^proc(\d+)$")

DumpKey = tuple[int | None, int | None]


class DumpError(ValueError):
    """A dump that cannot be used; the message names the file (and entry) at fault."""


def read_json(path: Path) -> Any:
    """Parse a JSON file (NaN/Infinity allowed); errors name the file, line and column."""
    try:
        return json.loads(read_utf8(path))
    except FileNotFoundError:
        raise DumpError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise DumpError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except OSError as e:
        raise DumpError(f"{path}: cannot read: {e}") from None
    except ValueError as e:  # not UTF-8 (read_utf8 names the file, line and column)
        raise DumpError(str(e)) from None


@dataclass
class RankDump:
    """One rank directory: the parsed dump.json and lazy access to its tensors."""
    path: Path
    step: int | None
    rank: int | None
    meta: dict[str, Any]
    data: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    _tensor_base: Path | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def task(self) -> str:
        return self.meta.get("task", "")

    @property
    def framework(self) -> str:
        return self.meta.get("framework", "")

    @property
    def dump_json(self) -> Path:
        return self.path / DUMP_JSON

    def construct(self) -> dict[str, Any]:
        """construct.json (entry -> parent entry), or {} when the file is absent."""
        file = self.path / CONSTRUCT_JSON
        return read_json(file) if file.exists() else {}

    def stack(self) -> dict[str, Any]:
        """stack.json as entry -> call stack (either layout: grouped, as mindstudio-probe 26.2
        writes it, or one list per entry, as 1.x does), or {} when the file is absent."""
        file = self.path / STACK_JSON
        return stack_by_entry(read_json(file)) if file.exists() else {}

    def tensor_file(self, ref: TensorRef) -> Path:
        """The file of a tensor record, checked to lie inside dump_tensor_data/."""
        where = f"{self.dump_json}: data[{ref.entry!r}].{ref.label}"
        name = ref.record.get("data_name")
        if not isinstance(name, str) or not name:
            raise DumpError(f"{where}: no 'data_name' (dump task {self.task!r} saved no tensor)")
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts:
            raise DumpError(f"{where}: data_name {name!r} must be a plain name inside {TENSOR_DIR}/")
        if self._tensor_base is None:
            self._tensor_base = (self.path / TENSOR_DIR).resolve()
        base = self._tensor_base
        if len(rel.parts) == 1:  # the usual case: a regular file (not a link) right in base is inside
            try:
                if stat.S_ISREG(os.lstat(base / rel).st_mode):
                    return base / rel
            except OSError:
                pass  # missing, or not readable: the full check below says which
        file = (base / rel).resolve()
        if base != file and base not in file.parents:
            raise DumpError(f"{where}: data_name {name!r} resolves outside {TENSOR_DIR}/ (to {file})")
        if not file.is_file():
            raise DumpError(f"{where}: tensor file {self.path / TENSOR_DIR / rel} is missing")
        return file

    def load_tensor(self, ref: TensorRef) -> np.ndarray:
        """Load one tensor as a numpy array (bfloat16 and other types numpy lacks become float32)."""
        return self._load(ref, mapped=False)

    def open_tensor(self, ref: TensorRef) -> Any:
        """One tensor for reading once, as compare does: a ``.pt`` file gives the torch tensor
        (its dtype kept, bfloat16 included) loaded with ``torch.load(weights_only=True, mmap=True)``,
        so the data is paged in from the file as it is read rather than copied up front; a
        ``.npy`` file gives a read-only ``np.load(mmap_mode="r", allow_pickle=False)`` array.
        The same checks as ``load_tensor`` apply."""
        return self._load(ref, mapped=True)

    def _load(self, ref: TensorRef, mapped: bool) -> Any:
        file = self.tensor_file(ref)
        where = f"{file} (data[{ref.entry!r}].{ref.label})"
        try:
            if file.suffix == ".npy":
                return np.load(file, mmap_mode="r" if mapped else None, allow_pickle=False)
            framework = framework_where(tensor_suffix=file.suffix)
            if framework is not None:
                return load_framework(framework).load_tensor_file(file, mapped)
        except Exception as e:  # torch.load/np.load raise many types for a corrupt or foreign file
            first = next(iter(str(e).splitlines()), "") or "(no message: an empty or truncated file?)"
            raise DumpError(f"{where}: cannot load tensor: {type(e).__name__}: {first}") from None
        raise DumpError(f"{where}: unknown tensor file type {file.suffix!r} (expected .pt or .npy)")


def stack_by_entry(doc: Any) -> dict[str, Any]:
    """``{"0": [[names], [frames]], ...}`` (grouped) or ``{name: [frames]}`` -> ``{name: [frames]}``."""
    if not isinstance(doc, dict):
        return {}
    if not (isinstance(doc.get("0"), list) and len(doc["0"]) == 2 and isinstance(doc["0"][0], list)):
        return doc
    found: dict[str, Any] = {}
    for group in doc.values():
        if isinstance(group, list) and len(group) == 2 and isinstance(group[0], list):
            found.update({name: group[1] for name in group[0] if isinstance(name, str)})
    return found


def load_rank_dir(path: Path, strict: bool = True) -> RankDump:
    """Load one rank directory; with ``strict`` schema problems raise, else they land in ``problems``."""
    if not path.is_dir():
        raise DumpError(f"{path}: not a directory")
    file = path / DUMP_JSON
    if not file.is_file():
        raise DumpError(f"{path}: no {DUMP_JSON} in this rank directory")
    doc = read_json(file)
    problems = validate_dump_json(doc)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise DumpError(f"{file}: " + "; ".join(problems))
    if strict and problems:
        raise DumpError(f"{file}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    if problems:  # tolerant: an entry whose records are malformed is left out (and listed), never half-read
        doc["data"] = {name: entry for name, entry in doc["data"].items() if not _malformed(name, entry, doc)}
    meta = {k: v for k, v in doc.items() if k != "data"}
    step_match = _STEP_RE.match(path.parent.name)
    rank_match = _RANK_RE.match(path.name)
    return RankDump(path=path, step=int(step_match.group(1)) if step_match else None,
                    rank=int(rank_match.group(1)) if rank_match and rank_match.group(1) else None,
                    meta=meta, data=doc["data"], problems=[f"{file}: {p}" for p in problems])


def _malformed(name: str, entry: Any, doc: dict[str, Any]) -> bool:
    """True for an entry a reader cannot walk: not an object, or a value of the wrong type
    (a name other tools write, or a missing key, is not malformed: readers take it as absent)."""
    task = doc.get("task") if isinstance(doc.get("task"), str) else "statistics"
    framework = doc.get("framework") if isinstance(doc.get("framework"), str) else "pytorch"
    return any(("expected " in p or " must be " in p) and "data_name" not in p
               for p in validate_entry(name, entry, task, framework))


def is_rank_dir_name(name: str) -> bool:
    """True for ``rank<R>``, ``rank`` and ``proc<pid>``."""
    return bool(_RANK_RE.match(name) or _PROC_RE.match(name))


def _rank_order(d: Path) -> tuple[int, int]:
    m = _RANK_RE.match(d.name)
    return (0, int(m.group(1) or -1)) if m else (1, int(d.name[4:]))


def _rank_dirs(step_dir: Path) -> list[Path]:
    return sorted((d for d in step_dir.iterdir() if d.is_dir() and is_rank_dir_name(d.name)), key=_rank_order)


def find_rank_dirs(path: Path | str) -> list[Path]:
    """The rank directories under a rank dir, a step dir or a dump_path root, in (step, rank) order."""
    path = Path(path)
    if not path.exists():
        raise DumpError(f"{path}: no such directory")
    if not path.is_dir():
        raise DumpError(f"{path}: not a directory")
    if (path / DUMP_JSON).exists():
        return [path]
    found = _rank_dirs(path)
    if not found:
        steps = sorted((d for d in path.iterdir() if d.is_dir() and _STEP_RE.match(d.name)),
                       key=lambda d: int(d.name[4:]))
        found = [r for s in steps for r in _rank_dirs(s)]
    if not found:
        raise DumpError(f"{path}: no {DUMP_JSON} here and no step*/rank*/, step*/proc*/, rank*/ or proc*/ "
                        "directories below")
    return found


def load_dump(path: Path | str, strict: bool = True) -> dict[DumpKey, RankDump]:
    """Load a rank directory or every rank directory of ``step*/`` below a dump root, keyed by (step, rank).

    ``step``/``rank`` are None where the directory names carry no rank (``proc<pid>`` or a bare
    ``rank`` dir of a single-process run). With ``strict`` (default) any schema problem raises
    ``DumpError``; otherwise problems are kept in ``RankDump.problems``.
    """
    dumps: dict[DumpKey, RankDump] = {}
    for rank_dir in find_rank_dirs(path):
        dump = load_rank_dir(rank_dir, strict=strict)
        dumps[(dump.step, dump.rank)] = dump
    return dumps
