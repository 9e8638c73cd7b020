"""A fused single-pass reduction (Triton) of many CUDA tensors into partial-statistics rows.

What it computes: for each float32/float16/bfloat16 tensor of a call, the row of
`msprobe_engine.stats.columns` (min, max, sum, sumsq, nan_count, inf_count, zero_count, numel)
with the torch backend's semantics: a tensor holding a nan has nan min and max (and, by IEEE
arithmetic, nan sum and sumsq); +-inf are kept in min/max/sum; the zero count is nan unless
asked for, except for an empty tensor (0); an empty tensor's row is the merge identities
(+inf, -inf, 0, ...).

How: every tensor is cut into segments of at most SEGMENT elements (an empty tensor is one
segment of none). A table of three int64 per tensor (its address, its length, its first
segment) goes to the device in one non-blocking copy from pinned memory: host work and the
copy grow with the number of tensors, not their size. Two launches per dtype then serve all
the tensors of the call, whatever their number and sizes:

1. `fused_reduce_kernels.segment_kernel`, one program per segment: it finds its tensor by a
   binary search of the first segments, reads its segment once, BLOCK elements at a time
   (unmasked loads, 128-bit when every address is 16-byte aligned, then one masked tail), and
   keeps per lane a float32 running min, max, sum and sum of squares and int32 counts of nan,
   inf and zeros (nan left out of min/max; fp16/bf16 converted to float32, exactly); it
   reduces its lanes and writes one float64 row per segment (its length in the numel column).
2. `fused_reduce_kernels.combine_kernel`, one program per tensor: merges its segments' rows
   in float64 (min of mins, max of maxes, the rest added) and writes the tensor's row: min and
   max nan where a nan was counted, the zero count nan when not asked for (0 for an empty tensor).

Every tensor's row depends on its own values only (no atomics, a fixed order): the same
tensor gives the same bits in any batch, and run to run.

Precision: float32 within a lane (at most SEGMENT / BLOCK = 16 additions) and a float32 tree
over BLOCK lanes, then float64 across segments. Measured in the interpreter against float64
(randn, 1k-300k elements, fp32/bf16/fp16): relative error of the sum of squares 1e-8 to
1.3e-7 (the torch path: up to 9e-7 for bf16), of the sum 1e-9 to 2e-8 of the sum of |x|;
the backend's tests allow 1e-5 above SMALL_NUMEL and 1e-6 below. (The torch path sums a
large tensor in float32 as a whole; here a segment's sum is float32 and the segments are
added in float64, so a sum that overflows float32 only over the whole tensor is finite here.)

Non-contiguous tensors are copied with `.contiguous()` first (one extra read and write of that
tensor); float64, integer, bool, complex and sparse tensors are left to the torch path.

Selection: `backend.partial_stats` calls `measure` for CUDA tensors only (`DEVICES`); it returns None
(the torch path measures everything) when Triton cannot be imported, when
``MSPROBE_FUSED_REDUCE=0`` is set or `ENABLED` is False, or after the kernel failed once
(the failure is logged once, the run goes on on the torch path). What is caught is what fails
at the call (no Triton, no backend for the device, a compile or launch error); a fault inside
a running kernel would surface later as a CUDA error, as for any kernel.

Testing without a GPU: with ``TRITON_INTERPRET=1`` in the environment before Triton is
imported, `rows` runs the same kernels on CPU tensors in Triton's interpreter
(tests/test_fused_reduce.py does so in a subprocess).
"""
from __future__ import annotations

import array
import contextlib
import functools
import itertools
import logging
import os
from typing import Optional, Sequence

import torch

log = logging.getLogger("msprobe_engine")

#: Elements per lane-block step of a program (a power of two).
BLOCK = 1024
#: Elements per segment: one program reads at most this many (a multiple of BLOCK). Not tuned
#: on a GPU (none was available when this was written).
SEGMENT = 16 * BLOCK
#: Segments merged per step of the combining kernel (a power of two).
COMBINE_BLOCK = 64
#: The dtypes the kernel reads.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Device types `backend.partial_stats` hands to the kernel (the tests add "cpu" under the interpreter).
DEVICES: tuple[str, ...] = ("cuda",)
#: Environment switch: ``MSPROBE_FUSED_REDUCE=0`` (or ``off``/``false``/``no``) keeps the torch path.
ENV = "MSPROBE_FUSED_REDUCE"

#: False turns the kernel off for this process (set by hand, or after it failed once).
ENABLED = os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")
#: Why the kernel is not in use (None while it is, or has not been tried).
disabled_reason: Optional[str] = None if ENABLED else f"{ENV}={os.environ.get(ENV)}"


@functools.lru_cache(maxsize=None)
def _kernels():
    """The two jitted kernels and the dtype map (Triton imported on first use only)."""
    from msprobe_engine.frameworks.torch import fused_reduce_kernels as k
    return k.segment_kernel, k.combine_kernel, k.DTYPES


def available() -> bool:
    """Whether the kernel may be used now: enabled, and Triton importable."""
    if not ENABLED:
        return False
    try:
        _kernels()
    except Exception as exc:  # ImportError, or a Triton that cannot build the kernels
        _disable(f"Triton unavailable ({type(exc).__name__}: {exc})")
        return False
    return True


def _disable(reason: str) -> None:
    global ENABLED, disabled_reason
    ENABLED, disabled_reason = False, reason
    log.warning("msprobe: fused reduction kernel off, statistics use the torch path: %s", reason)


def rows(tensors: Sequence[torch.Tensor], count_zeros: bool = False) -> torch.Tensor:
    """``[len(tensors), 8]`` float64 rows of `tensors` (strided, one dtype of `DTYPES`, one
    device) by the two kernels, on that device. Raises what Triton raises."""
    segment_kernel, combine_kernel, dtypes = _kernels()
    device = tensors[0].device
    dtype = tensors[0].dtype
    flats = [t if t.is_contiguous() else t.contiguous() for t in tensors]  # kept alive until launched
    addresses = [f.data_ptr() for f in flats]
    numels = [f.numel() for f in flats]
    starts = list(itertools.accumulate(((n + SEGMENT - 1) // SEGMENT or 1 for n in numels), initial=0))
    n_tensors, n_segments = len(flats), starts[-1]  # an empty tensor has one segment, of no elements
    table = torch.frombuffer(array.array("q", addresses + numels + starts), dtype=torch.int64)
    if device.type == "cuda":  # one host-to-device copy that does not wait for the device queue
        table = table.pin_memory().to(device, non_blocking=True)
    partials = torch.empty((n_segments, 8), dtype=torch.float64, device=device)
    out = torch.empty((n_tensors, 8), dtype=torch.float64, device=device)
    options = {"num_warps": 4, "enable_fp_fusion": True}  # fusion: x*x + acc as one fma (said, not defaulted)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        segment_kernel[(n_segments,)](table, n_tensors, max(0, n_tensors - 1).bit_length(), partials,
                                      DTYPE=dtypes[dtype], SEGMENT=SEGMENT, BLOCK=BLOCK,
                                      ALIGNED=all(a % 16 == 0 for a in addresses), **options)
        combine_kernel[(n_tensors,)](partials, table[2 * n_tensors:], out, COUNT_ZEROS=bool(count_zeros),
                                     BLOCK=COMBINE_BLOCK, **options)
    del flats
    return out


def eligible(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether the kernel reads `tensor` (a strided float32/16/bf16 tensor on `device`)."""
    return tensor.layout == torch.strided and tensor.dtype in DTYPES and tensor.device == device


def measure(tensors: Sequence[torch.Tensor], count_zeros: bool) -> Optional[tuple[list[int], torch.Tensor]]:
    """The hook of `backend.partial_stats` (on CUDA, `DEVICES`): ``(positions, rows)`` of the tensors the
    kernel measured (those `eligible` on the first tensor's device; positions ascending), or
    None when it measured none (off, no Triton, nothing eligible, or it failed: then it is
    off for the rest of the run and the torch path measures everything)."""
    if not tensors or not available():
        return None
    device = tensors[0].device
    by_dtype: dict[torch.dtype, list[int]] = {}
    for pos, tensor in enumerate(tensors):
        if eligible(tensor, device):
            by_dtype.setdefault(tensor.dtype, []).append(pos)
    if not by_dtype:
        return None
    try:
        with torch.no_grad():
            blocks = [(positions, rows([tensors[p].detach() for p in positions], count_zeros))
                      for positions in by_dtype.values()]
    except Exception as exc:  # a kernel that does not build or launch here: once, then the torch path
        _disable(f"the kernel failed ({type(exc).__name__}: {exc})")
        return None
    if len(blocks) == 1:
        return blocks[0]
    # several dtypes: put the rows in position order here, with an index copied without blocking
    # (`backend.concat` would reorder them with a blocking copy)
    order = [pos for positions, _ in blocks for pos in positions]
    index = torch.frombuffer(array.array("q", sorted(range(len(order)), key=order.__getitem__)), dtype=torch.int64)
    if device.type == "cuda":
        index = index.pin_memory().to(device, non_blocking=True)
    return sorted(order), torch.cat([r for _, r in blocks]).index_select(0, index)
