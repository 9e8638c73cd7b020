"""A single-pass reduction (C, loaded with ctypes) of many CPU tensors into partial-statistics rows.

What it computes: for each float32/float64/float16/bfloat16/int64/int32 tensor of a call, the row of
`msprobe_engine.stats.columns` (min, max, sum, sumsq, nan_count, inf_count, zero_count, numel)
with the torch backend's semantics (those of `fused_reduce`, its CUDA counterpart): a tensor
holding a nan has nan min and max; +-inf are kept in min/max/sum; the zero count is nan unless
asked for (0 for an empty tensor); an empty tensor's row is the merge identities.

Why: the torch path reads a tensor four or five times (sum; min and max; the chunk norms; the
zero count) with a Python call and a dispatch each, and leaves 0-dim results to be packed at the
step's end. This reads it once, in one call for all the tensors of a batch, and writes their
rows straight into one float64 tensor (measured, 1 thread, this CPU: 32k float32 elements in
about 10 us against about 40 us).

How (`msprobe_engine/cpu_kernel/cpu_reduce.c`): LANES running minima, maxima, sums and sums of squares (and zero counts,
when asked) that the compiler vectorises; float32/16/bf16 values summed in float32 for 16 values
per lane, then in float64; squares taken and summed in float64 (exact squares: a sum of squares
that overflows or underflows float32 is still right here, unlike the torch path's); float64
tensors, and int64/int32 ones read as float64 (as the torch path converts them: token ids, positions), in
float64 throughout; nan and inf counted by a second loop only when the sum or the sum
of squares is not finite (a finite one proves there is none). On x86-64 the loops are compiled for
AVX-512, AVX2 and the baseline and picked at load time by what the CPU has.
Three entries: `msprobe_cpu_rows` reads a batch through a lookup table (addresses, lengths,
dtype codes); `msprobe_cpu_row` takes one tensor's address, length and dtype as arguments (a
hook's one tensor, the common call: no table to build, about 2 us less Python per call);
`msprobe_cpu_diff_rows` (`difference_rows`) gives the rows of differences ``a - b`` of float32 or
float64 tensors without writing them (the optimizer's update: two reads a parameter instead of the
difference's write and its read back).

Building and loading: `msprobe_engine.cpu_kernel.library` (the library built into the package at
install time, or at run time with ``MSPROBE_CPU_KERNEL=build``; no compiler needed where the package
is installed). `prepare()` loads (or builds) it ahead (the torch framework does so when a monitor
attaches), so the training thread does not wait in its first monitored step.

Selection: `backend.partial_stats` calls `measure` for CPU tensors; it returns None (the torch
path measures everything) when ``MSPROBE_CPU_KERNEL=0`` is set or `ENABLED` is False, or when
the library cannot be built or loaded (logged once). A tensor is left to the torch path when
it is a tensor subclass (a DTensor: its `data_ptr` is not its values), nested, not strided, of
another dtype, a negated view, or (with torch using more than one
thread) longer than `PARALLEL_NUMEL`, where torch's multi-threaded reductions may be faster.
Non-contiguous tensors are copied with `.contiguous()` first. A tensor whose storage is smaller
than its values (freed under it) raises ValueError instead of being read out of bounds (the
monitor reports it; the run goes on).
"""
from __future__ import annotations

import array
import ctypes
import functools
import logging
from typing import Optional, Sequence

import torch

from msprobe_engine.cpu_kernel import library

log = logging.getLogger("msprobe_engine")

#: The dtypes the kernel reads, with their codes in the C file.
DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.int64: 4, torch.int32: 5}
#: The dtypes whose differences the kernel reads (`difference_rows`).
_DIFF_DTYPES = (torch.float32, torch.float64)
#: With torch on more than one thread, tensors longer than this stay on torch's parallel reductions.
PARALLEL_NUMEL = 1 << 20
#: Tensor types whose `data_ptr` is their values (a subclass such as a DTensor wraps its data elsewhere).
_PLAIN = (torch.Tensor, torch.nn.Parameter)

#: False turns the kernel off for torch in this process (set by hand, or after it could not be loaded).
ENABLED = library.SWITCHED_OFF is None
#: Why the kernel is not in use (None while it is, or has not been tried).
disabled_reason: Optional[str] = library.SWITCHED_OFF


@functools.lru_cache(maxsize=None)
def _table_entry(name: str):
    """The C function `name` that reads tensors by a lookup table: (count, table, count_zeros, out)."""
    function = getattr(library.handle(), name)
    function.restype = None
    function.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p]
    return function


def _entry():
    """The C function `msprobe_cpu_rows` (many tensors, by a lookup table)."""
    return _table_entry("msprobe_cpu_rows")


def _entry_diff():
    """The C function `msprobe_cpu_diff_rows` (differences of pairs, by a lookup table)."""
    return _table_entry("msprobe_cpu_diff_rows")


@functools.lru_cache(maxsize=None)
def _entry_one():
    """The C function `msprobe_cpu_row` (one tensor: address, length and dtype code as arguments)."""
    function = library.handle().msprobe_cpu_row
    function.restype = None
    function.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]
    return function


_loaded = False  # both entries loaded (a plain flag: `available` is asked once per measured batch)


def available() -> bool:
    """Whether the kernel may be used now: enabled and loaded (built first with ``build``)."""
    global _loaded
    if not ENABLED:
        return False
    if _loaded:
        return True
    try:
        _entry(), _entry_one(), _entry_diff()
    except Exception as exc:  # not packaged, no compiler, a compile error, a library that does not load
        _disable(f"the C kernel is unavailable ({type(exc).__name__}: {exc})")
        return False
    _loaded = True
    return True


prepare = available  # build (or load) ahead of the first measurement


def _disable(reason: str) -> None:
    global ENABLED, disabled_reason
    ENABLED, disabled_reason = False, reason
    log.warning("msprobe: CPU reduction kernel off, statistics use the torch path: %s", reason)


def rows(tensors: Sequence[torch.Tensor], count_zeros: bool = False) -> torch.Tensor:
    """``[len(tensors), 8]`` float64 rows of strided CPU tensors of `DTYPES` (mixed dtypes
    allowed), by one call of the C kernel."""
    if len(tensors) == 1:
        return _fill_one(tensors[0], count_zeros, torch.empty(1, 8, dtype=torch.float64))
    if not all(t.is_contiguous() for t in tensors):
        with torch.no_grad():
            tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]  # alive during the call
    for t in tensors:
        check_storage(t)
    table = array.array("q", [*[t.data_ptr() for t in tensors], *[t.numel() for t in tensors],
                              *[DTYPES[t.dtype] for t in tensors]])
    out = torch.empty(len(tensors), 8, dtype=torch.float64)
    fill_rows(len(tensors), table, count_zeros, out)
    return out


def fill_rows(count: int, table: array.array, count_zeros: bool, out: torch.Tensor) -> None:
    """The kernel's many-tensor call: the rows of `count` tensors, given by `table` (their
    addresses, then lengths, then dtype codes; int64), into the first `count` rows of `out`
    (contiguous float64, 8 columns)."""
    _entry()(count, table.buffer_info()[0], 1 if count_zeros else 0, out.data_ptr())


def difference_rows(after: Sequence[torch.Tensor], before: Sequence[torch.Tensor],
                    count_zeros: bool = False) -> Optional[torch.Tensor]:
    """``[len(after), 8]`` float64 rows of ``after[i] - before[i]`` (exactly torch's difference),
    by one call of the C kernel that never writes the differences; None when the kernel is off or
    any pair is not two `eligible` contiguous tensors of one shape and dtype, float32 or float64."""
    if not after or not (ENABLED and available()):
        return None
    parallel = torch.get_num_threads() > 1
    for a, b in zip(after, before):
        if not (a.dtype == b.dtype and a.dtype in _DIFF_DTYPES and a.shape == b.shape and a.is_contiguous()
                and b.is_contiguous() and eligible(a, parallel) and eligible(b, parallel)):
            return None
        check_storage(a)
        check_storage(b)
    table = array.array("q", [*[a.data_ptr() for a in after], *[b.data_ptr() for b in before],
                              *[a.numel() for a in after], *[DTYPES[a.dtype] for a in after]])
    out = torch.empty(len(after), 8, dtype=torch.float64)
    _entry_diff()(len(after), table.buffer_info()[0], 1 if count_zeros else 0, out.data_ptr())
    return out


def row(tensor: torch.Tensor, count_zeros: bool = False) -> torch.Tensor:
    """The 8 float64 values of one strided CPU tensor's row (of `DTYPES`), by the kernel's
    one-tensor call: `rows` of one tensor without the ``[1, 8]`` shape (for `opaque_row`'s op)."""
    return _fill_one(tensor, count_zeros, torch.empty(8, dtype=torch.float64))


def _fill_one(tensor: torch.Tensor, count_zeros: bool, out: torch.Tensor) -> torch.Tensor:
    """`out` (8 contiguous float64 values) filled with `tensor`'s row: its address, length and dtype
    passed straight (no lookup table)."""
    if not tensor.is_contiguous():
        with torch.no_grad():
            tensor = tensor.contiguous()
    check_storage(tensor)
    _entry_one()(tensor.data_ptr(), tensor.numel(), DTYPES[tensor.dtype], 1 if count_zeros else 0, out.data_ptr())
    return out


def check_storage(t: torch.Tensor) -> None:
    """A storage freed under its tensor (a sharding wrapper's) would be read out of bounds: raise."""
    nbytes = t.untyped_storage().nbytes()
    if nbytes < (t.storage_offset() + t.numel()) * t.element_size():
        raise ValueError(f"a {t.dtype} tensor of shape {tuple(t.shape)} has {nbytes} bytes "
                         "of storage, fewer than its values need (freed by a sharding wrapper?)")


def eligible(tensor: torch.Tensor, parallel: bool) -> bool:
    """Whether the kernel reads `tensor` (see the module docstring)."""
    return (type(tensor) in _PLAIN and tensor.is_cpu and tensor.dtype in DTYPES and tensor.layout == torch.strided
            and not tensor.is_nested and not tensor.is_neg() and not (parallel and tensor.numel() > PARALLEL_NUMEL))


def measure(tensors: Sequence[torch.Tensor], count_zeros: bool) -> Optional[tuple[list[int], torch.Tensor]]:
    """The hook of `backend.partial_stats` on CPU: ``(positions, rows)`` of the tensors the kernel
    measured (positions ascending), or None when it measured none (off, not built, none eligible)."""
    if not tensors or not (ENABLED and available()):
        return None
    parallel = torch.get_num_threads() > 1
    if len(tensors) == 1:  # a hook's one tensor
        return ([0], rows(tensors[:1], count_zeros)) if eligible(tensors[0], parallel) else None
    positions = [pos for pos, tensor in enumerate(tensors) if eligible(tensor, parallel)]
    if not positions:
        return None
    return positions, rows([tensors[p] for p in positions], count_zeros)
