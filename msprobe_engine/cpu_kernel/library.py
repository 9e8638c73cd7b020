"""Where the C kernel's shared library comes from: built into the package at install time, or at run time.

At install time setup.py builds `cpu_reduce.c` into this package as the plain shared library
`_cpu_reduce*.so` (with `FLAGS`; `pip install`, also `pip install -e`), and it is loaded from the
package only: no compiler is needed where the package is installed. A checkout used without
installing (PYTHONPATH) has no library; there the kernel is built at run time only when asked
(``MSPROBE_CPU_KERNEL=build``): compiled with ``$CC`` (else ``cc``) into a cache folder
(``$MSPROBE_CACHE_DIR``, else ``$XDG_CACHE_HOME/msprobe_engine`` or ``~/.cache/msprobe_engine``)
that must be the user's own and writable by nobody else, under a file lock (ranks starting
together compile once), named by a hash of the source, the flags, the machine architecture and
the compiler's identity (its resolved path and ``--version``). ``MSPROBE_CPU_KERNEL=0`` (or
``off``/``false``/``no``) keeps every framework on its own reductions.

`handle()` is the library loaded with ctypes (once a process); `path()` its file (MindSpore's custom
operators name it). Both raise RuntimeError saying why when there is none; a library built from an
older source (reading fewer dtype codes than this one) is refused, never misread.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import importlib.machinery
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).with_name("cpu_reduce.c")
#: Compiler flags (no -ffast-math: it would drop the nan and signed-zero semantics).
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11")
#: How many dtype codes `cpu_reduce.c` reads (its `msprobe_cpu_dtypes()`; the frameworks map theirs to them).
DTYPE_CODES = 6
#: Environment switch (see the module docstring).
ENV = "MSPROBE_CPU_KERNEL"
#: The library setup.py builds into the package (an extension name, no Python API inside).
PACKAGED = "_cpu_reduce"

MODE = os.environ.get(ENV, "1").strip().lower()
#: Why the kernel is switched off for this process by the environment (None: it is not).
SWITCHED_OFF: Optional[str] = f"{ENV}={os.environ.get(ENV)}" if MODE in ("0", "off", "false", "no") else None


def packaged() -> Optional[Path]:
    """The library built into the package at install time, or None (a checkout not installed)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        found = SOURCE.with_name(PACKAGED + suffix)
        if found.is_file():
            return found
    return None


def cache_dir() -> Path:
    """Where a library built at run time (``MSPROBE_CPU_KERNEL=build``) is kept."""
    if os.environ.get("MSPROBE_CACHE_DIR"):
        return Path(os.environ["MSPROBE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "msprobe_engine"


def _compiler() -> tuple[str, bytes]:
    """The C compiler's resolved path and its identity (path and ``--version``), for the cache key."""
    name = os.environ.get("CC") or "cc"
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"no C compiler {name!r} on PATH (set CC) to build {SOURCE.name}")
    resolved = os.path.realpath(found)
    version = subprocess.run([resolved, "--version"], capture_output=True, timeout=60).stdout
    return resolved, resolved.encode() + b"\0" + version


def _private(folder: Path) -> None:
    """Refuse a cache folder that someone else owns or may write into (they could plant code)."""
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"the kernel cache {folder} is not private (owned by uid {info.st_uid}, mode "
                           f"{stat.filemode(info.st_mode)}): make it the user's own, not writable by others")


def build() -> Path:
    """The library in the cache, compiled first if it is not there (once per source, flags,
    machine architecture and compiler; under a lock, so ranks starting together compile once)."""
    compiler, identity = _compiler()
    key = b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), platform.machine().encode(), identity])
    folder = cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _private(folder)
    target = folder / f"cpu_reduce-{hashlib.sha256(key).hexdigest()[:16]}.so"
    with open(folder / f"{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then renamed
            built = Path(tmp) / target.name
            proc = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)],
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {proc.stderr.strip()[-2000:]}")
            os.replace(built, target)
    return target


def path() -> Path:
    """The package's library, or the one built at run time when ``MSPROBE_CPU_KERNEL=build``."""
    if SWITCHED_OFF:
        raise RuntimeError(f"the C kernel is switched off ({SWITCHED_OFF})")
    if MODE == "build":
        return build()
    found = packaged()
    if found is None:
        raise RuntimeError(f"{PACKAGED} was not built into the package (install it with pip, which compiles "
                           f"it, or set {ENV}=build to compile it at run time)")
    return found


@functools.lru_cache(maxsize=None)
def handle() -> ctypes.CDLL:
    """The kernel's library, loaded (or built) on first use, and checked to read `DTYPE_CODES` codes."""
    library = ctypes.CDLL(str(path()))
    function = getattr(library, "msprobe_cpu_dtypes", None)  # absent from the libraries before int64 and int32
    if function is not None:
        function.restype = ctypes.c_int64
    count = function() if function is not None else 4
    if count != DTYPE_CODES:
        raise RuntimeError(f"{library._name} reads {count} dtypes where {SOURCE.name} has {DTYPE_CODES}: "
                           f"it was built from an older source (install the package again, or set {ENV}=build)")
    return library
