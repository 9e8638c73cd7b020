"""The C kernel (`msprobe_engine.cpu_kernel`) as MindSpore custom operators, for compiled graphs on CPU.

In a GRAPH_MODE graph, MindSpore's reductions of one tensor's row (`graph_rows.tensor_row`,
`backend.stat_rows`) are a dozen kernels each (cast, min/max, chunked sums, the finiteness
branch, concatenations); the C kernel reads each tensor once. `ops.Custom(..., func_type="aot")`
calls its MindSpore entries (`msprobe_ms_rows`, `msprobe_ms_diff_rows`, each with a ``_zeros``
twin that counts zeros) from inside the graph: a bool flag and N tensors in, their ``[N, 8]``
float64 rows out (nan rows, no tensor read, when the flag is false: how an unmonitored step skips
the statistics without a branch in the graph, which costs MindSpore's CPU backend about 1.6 ms a
step on its own),
with the semantics of the torch backend's CPU kernel (float32/16/bf16 summed in float32 per 16
values a lane, then in float64; squares summed in float64; a tensor holding a nan has nan min and
max; nan and inf counted exactly). Measured: 24 float32 tensors' rows in 0.96 ms a graph call
against 4.6-6.3 ms by MindSpore's reductions (docs/mindspore.md).

Used where `usable()` holds: the device is the CPU, the library is built (or loaded), and every
tensor is non-empty and of `DTYPES` (float32, float64, float16, bfloat16, int64, int32);
elsewhere the graphs keep MindSpore's reductions. The operators have no bprop: their inputs are
passed through `ops.stop_gradient` by the callers inside differentiated code.
``MSPROBE_CPU_KERNEL=0`` turns them off, as it does the torch side's.
"""
from __future__ import annotations

import functools
import logging
from typing import Iterable, Optional

import mindspore as ms
from mindspore import ops

from msprobe_engine.cpu_kernel import library

log = logging.getLogger("msprobe_engine")

#: the dtypes the kernel reads (`ms_code` in cpu_reduce.c); differences: float32 and float64 only
DTYPES = (ms.float32, ms.float64, ms.float16, ms.bfloat16, ms.int64, ms.int32)
DIFF_DTYPES = (ms.float32, ms.float64)
#: the kernel's row width (the built-in columns)
WIDTH = 8

#: Why the operators are not in use (None while they are, or have not been tried).
disabled_reason: Optional[str] = library.SWITCHED_OFF


@functools.lru_cache(maxsize=None)
def _library_path() -> Optional[str]:
    """The kernel library's file, or None (logged once) when there is none."""
    global disabled_reason
    if disabled_reason is not None:
        return None
    try:
        library.handle()  # loads and checks it (an older build is refused)
        return str(library.path())
    except Exception as exc:  # not packaged, no compiler, a compile error, a library that does not load
        disabled_reason = f"the C kernel is unavailable ({type(exc).__name__}: {exc})"
        log.warning("msprobe: MindSpore graphs measure with MindSpore's reductions: %s", disabled_reason)
        return None


def usable(tensors: Iterable, differences: bool = False) -> bool:
    """Whether the operators may measure `tensors` (anything with `dtype` and `size`) in a graph on
    this device: the CPU, the library there, every tensor non-empty and of a kernel dtype."""
    kinds = DIFF_DTYPES if differences else DTYPES
    if ms.get_context("device_target") != "CPU":
        return False
    if not all(t.size > 0 and t.dtype in kinds for t in tensors):
        return False
    return _library_path() is not None


@functools.lru_cache(maxsize=None)
def rows_op(count_zeros: bool) -> ops.Custom:
    """The operator: a bool flag and tensors ``x_0..x_{n-1}`` in, their ``[n, 8]`` float64 rows out."""
    return _custom("msprobe_ms_rows_zeros" if count_zeros else "msprobe_ms_rows", _rows_shape(1))


@functools.lru_cache(maxsize=None)
def diff_rows_op(count_zeros: bool) -> ops.Custom:
    """The operator: a bool flag and ``a_0..a_{k-1}, b_0..b_{k-1}`` in, the ``[k, 8]`` rows of
    ``a_i - b_i`` out (never written: two reads a pair)."""
    return _custom("msprobe_ms_diff_rows_zeros" if count_zeros else "msprobe_ms_diff_rows", _rows_shape(2))


@functools.lru_cache(maxsize=None)
def write_op(count_zeros: bool) -> ops.Custom:
    """The operator of a graph tap's write (`graph_rows.write_tensor`): a bool flag, the statistics
    Parameter, the rows written (int32 ``[slot, counter row]``) and a tensor in; the slot's row merged
    with the tensor's (its order and meta columns too) and the Parameter's new counter row out
    (``[2, width]``), for one scatter."""
    return _custom("msprobe_ms_write_zeros" if count_zeros else "msprobe_ms_write",
                   lambda on, buffer, *rest: (2, buffer[1]))


def _custom(entry: str, out_shape) -> ops.Custom:
    path = _library_path()
    if path is None:
        raise RuntimeError(f"the MindSpore kernel operators are off: {disabled_reason}")
    return ops.Custom(f"{path}:{entry}", out_shape=out_shape, out_dtype=ms.float64, func_type="aot")


def _rows_shape(per_row: int):
    """The output shape of a rows operator whose inputs are a flag and `per_row` tensors a row."""
    return lambda *shapes: ((len(shapes) - 1) // per_row, WIDTH)
