"""Batched partial statistics of many torch tensors, on their own device.

Three paths, by length:

- small tensors (up to SMALL_NUMEL elements) are grouped by size class (lengths within a
  factor of two) and dtype, padded into one float64 matrix per class and reduced along its
  rows: about a dozen kernel launches per class for all of them;
- mid-size tensors (up to FOREACH_NUMEL) are grouped by dtype and device and, in groups of
  MIN_BATCH or more, reduced by multi-tensor kernels: one `_foreach_norm` (float32
  accumulation, the whole tensor: relative error below 1e-6 at this length) for the whole
  group, one sum per tensor, min and max (on CPU one `aminmax` per tensor, measured alone
  1.4-3x cheaper than `_foreach_max` and a min each for every dtype; elsewhere `_foreach_max`
  and a min each), and one stacked finiteness check instead of one per tensor;
- large tensors are reduced one by one with torch's vectorised reductions, whose per-call
  overhead is small next to their size: min and max (two passes for float32, where that is
  faster than `aminmax`), sum, and the vector of their chunk norms.

Each leaves a few results (0-dim min/max, sum and counts, and a vector of chunk norms) that
are packed into rows by a dozen batched ops, the chunk norms of all tensors squared and
summed per tensor in float64 by one segmented sum. Floating-point tensors are accumulated
in float32 (bf16/fp16/fp32; the sum of squares of a large tensor per chunk of NORM_CHUNK
elements, the chunks in float64) or float64 (float64); mid-size and large tensors are never
copied to float64. Small ones and integer/bool tensors are converted to float64.

(`torch.var_mean` per chunk would give sum and sum of squares in one pass, but
on CPU it is a scalar Welford loop, 20-35 times slower than sum plus norm.)

Packing can wait: `partial_stats(..., deferred=True)` reduces at once (a
tensor may change in place afterwards) but returns a `Pending` block, and
`concat` packs the 0-dim results of all of a step's pending blocks together,
so a hook that measures one or two tensors pays for their reductions only.
`pick` repeats rows already measured (a tensor seen again) as a new block, by reference.

nan/inf counting costs two extra passes over the data. On CPU tensors, where
reading a scalar stalls no device queue, the counts are taken only when the
sum is not finite (a finite sum proves there is no nan or inf); on
accelerators they are always counted on the device, with no host
synchronisation. The zero count (for `zero_frac`) is only taken on request (on CPU not for a
tensor whose values all have one sign: it has no zero).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence, Union

import torch
from torch.nn.utils.rnn import pad_sequence

from msprobe_engine.frameworks.torch import cpu_reduce, fused_reduce
from msprobe_engine.frameworks.torch.later_rows import LaterRows  # noqa: F401  (the backend's batch: `StepRows.later`)
from msprobe_engine.stats import columns
from msprobe_engine.stats.columns import BUILTIN, N_BUILTIN

#: Tensors up to this many elements are batched by size class into padded matrices
#: (measured on CPU: above ~2k elements three vectorised reductions per tensor are cheaper).
SMALL_NUMEL = 2048
#: Tensors above SMALL_NUMEL and up to this many elements are reduced by multi-tensor kernels,
#: a group of one dtype and device at a time (the whole tensor's sum of squares in float32:
#: measured relative error 5.7e-7 at this length, 1.3e-6 at twice it).
FOREACH_NUMEL = 65536
#: Large tensors' squares are summed in float32 per chunk of this many elements,
#: and the chunk sums in float64 (relative error about 1e-7 instead of 1e-4).
NORM_CHUNK = 4096

#: A size class of small tensors is padded into one matrix, and a group of mid-size tensors
#: reduced by multi-tensor kernels, only when it has this many members; fewer go through the
#: per-tensor path (cheaper below that).
MIN_BATCH = 4

_LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32)
_UNKNOWN = float("nan")
NOT_TAKEN, NO_ZEROS = -1, -2  # nonzero counts that are not counts (see `_constants`)


class Pending:
    """Statistics of a batch of tensors, reduced but not yet packed into rows (`concat` packs).

    For each tensor of the per-tensor path: its position in the batch, its results
    (0-dim `extremes`: min and max; `sums`; `counts`, int64: nan, inf and nonzero counts,
    the last -1 when not taken; `chunk_norms`, a vector per tensor) and its length.
    `blocks`: the rows packed by the other paths, with their positions."""
    __slots__ = ("size", "device", "positions", "extremes", "sums", "chunk_norms", "counts", "numels", "blocks")

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.device = device
        self.positions: list[int] = []
        self.extremes: list[torch.Tensor] = []
        self.sums: list[torch.Tensor] = []
        self.chunk_norms: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []
        self.numels: list[float] = []
        self.blocks: list[tuple[list[int], torch.Tensor]] = []

    def __len__(self) -> int:
        return self.size

    def absorb(self, other: "Pending") -> None:
        """Append `other`'s rows after this block's."""
        offset = self.size
        self.positions += [offset + pos for pos in other.positions]
        self.extremes += other.extremes
        self.sums += other.sums
        self.chunk_norms += other.chunk_norms
        self.counts += other.counts
        self.numels += other.numels
        self.blocks += [([offset + pos for pos in positions], rows) for positions, rows in other.blocks]
        self.size += other.size

    def add_rows(self, rows: torch.Tensor) -> None:
        """Append rows already packed."""
        self.blocks.append((list(range(self.size, self.size + len(rows))), rows))
        self.size += len(rows)


Rows = Union[torch.Tensor, Pending]


def partial_stats(tensors: Sequence[torch.Tensor], count_zeros: bool = False, deferred: bool = False) -> Rows:
    """Return a ``[len(tensors), n_columns()]`` float64 tensor of partial statistics.

    Columns follow `msprobe_engine.stats.columns`; the zero count is nan
    unless `count_zeros`. The result lives on the device of the first tensor;
    nothing is transferred to the host. `deferred`: return a `Pending` block
    instead (reduced, not packed), for `concat` to pack with the step's others.
    Registered columns (`columns.EXTRA`) are measured by their torch reducers, one
    tensor at a time, after the built-in ones (then the rows are packed at once).
    """
    if columns.EXTRA and tensors:
        rows = torch.cat([_builtin_stats(tensors, count_zeros), _extra_rows(tensors)], dim=1)
        return _as_pending(rows) if deferred else rows
    return _builtin_stats(tensors, count_zeros, deferred)


def difference_stats(after: Sequence[torch.Tensor], before: Sequence[torch.Tensor], count_zeros: bool = False,
                     deferred: bool = False) -> Rows:
    """`partial_stats` of the differences ``after[i] - before[i]`` (tensors of one shape and dtype
    each). On CPU, float32/float64, no registered columns: by the C kernel, the differences never
    written (`cpu_reduce.difference_rows`); elsewhere they are computed, then measured."""
    rows = cpu_reduce.difference_rows(after, before, count_zeros) \
        if after and after[0].is_cpu and not columns.EXTRA else None
    if rows is None:
        with torch.no_grad():
            return partial_stats(torch._foreach_sub(list(after), list(before)), count_zeros, deferred)
    return _as_pending(rows) if deferred else rows


def _as_pending(rows: torch.Tensor) -> Pending:
    """Rows already packed, as a `Pending` block."""
    block = Pending(0, rows.device)
    block.add_rows(rows)
    return block


def _extra_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(tensors), len(columns.EXTRA)]``: each registered column by its torch reducer (nan
    without one; its identity for an empty tensor)."""
    reducers = columns.extra_reducers("torch")
    with torch.no_grad():
        values = [[_extra(reduce, column, _values(t)) for reduce, column in zip(reducers, columns.EXTRA)]
                  for t in tensors]
    return torch.stack([torch.stack(row).to(tensors[0].device) for row in values])


def _extra(reduce: Any, column: columns.PartialColumn, flat: torch.Tensor) -> torch.Tensor:
    if reduce is None:
        return torch.tensor(_UNKNOWN, dtype=torch.float64, device=flat.device)
    if not flat.numel():
        return torch.tensor(column.identity, dtype=torch.float64, device=flat.device)
    return reduce(flat).to(torch.float64).reshape(())


def _builtin_stats(tensors: Sequence[torch.Tensor], count_zeros: bool = False, deferred: bool = False) -> Rows:
    """The built-in columns (`columns.BUILTIN`) of `partial_stats`."""
    device = tensors[0].device if tensors else torch.device("cpu")
    pending = Pending(len(tensors), device)
    # -- a single-pass kernel where there is one: C on CPU (cpu_reduce.py; MSPROBE_CPU_KERNEL=0 turns it
    # off), Triton on CUDA (fused_reduce.py; MSPROBE_FUSED_REDUCE=0): the rows of the tensors it measured,
    # as one block; the torch paths below measure the rest
    if device.type in fused_reduce.DEVICES:
        fused = fused_reduce.measure(tensors, count_zeros)
    elif device.type == "cpu":
        fused = cpu_reduce.measure(tensors, count_zeros)
    else:
        fused = None
    if fused is not None:
        pending.blocks.append(fused)
        if len(fused[0]) == len(tensors):
            return pending if deferred else concat([pending])
    elif len(tensors) == 1 and tensors[0].layout == torch.strided and not tensors[0].is_complex() \
            and tensors[0].numel():  # a hook's one tensor: straight to the per-tensor path
        _reduce(pending, 0, tensors[0].detach().reshape(-1), count_zeros)
        return pending if deferred else concat([pending])
    small: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    mid: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    first_pos: dict[int, int] = {}  # id of a tensor given more than once (x, x, x) -> its first position
    repeats: list[tuple[int, int]] = []
    taken = set(fused[0]) if fused is not None else ()
    with torch.no_grad():
        for pos, tensor in enumerate(tensors):
            if pos in taken:
                continue
            if tensor.layout != torch.strided or tensor.is_complex():
                tensor = _values(tensor)  # sparse: its stored values; complex: magnitudes
            numel = tensor.numel()
            if numel > SMALL_NUMEL:
                first = first_pos.setdefault(id(tensor), pos)
                if first != pos:
                    repeats.append((pos, first))
                elif numel <= FOREACH_NUMEL and tensor.is_floating_point():
                    mid.setdefault((tensor.dtype, tensor.device), []).append((pos, tensor))
                else:
                    _reduce(pending, pos, tensor.reshape(-1), count_zeros)
            else:
                flat = tensor.reshape(-1)
                key = ("empty",) if numel == 0 else ("small", numel.bit_length(), flat.dtype, flat.device)
                small.setdefault(key, []).append((pos, flat))
        for members in mid.values():
            if len(members) >= MIN_BATCH:
                _reduce_group(pending, [pos for pos, _ in members], [t for _, t in members], count_zeros)
            else:  # a hook's one or two tensors: fewer kernels one by one
                for pos, tensor in members:
                    _reduce(pending, pos, tensor.reshape(-1), count_zeros)
        for key, members in small.items():
            positions = [pos for pos, _ in members]
            if key[0] == "empty":
                pending.blocks.append((positions, _empty_rows(len(members), device)))
            elif len(members) >= MIN_BATCH:
                pending.blocks.append((positions, _small_rows([flat for _, flat in members], count_zeros)))
            else:
                for pos, flat in members:
                    _reduce(pending, pos, flat, count_zeros)
        if repeats:
            index = {pos: i for i, pos in enumerate(pending.positions)}
            for pos, first in repeats:
                _repeat(pending, pos, pending, index[first])
    return pending if deferred else concat([pending])


def _values(tensor: torch.Tensor) -> torch.Tensor:
    """The values a tensor's statistics are taken on, flat: a sparse tensor's stored values,
    a complex tensor's magnitudes (non-finite where either part is: |nan+1j| is nan, |inf+nanj| inf)."""
    flat = tensor.detach()
    if flat.layout != torch.strided:
        flat = flat.coalesce().values() if flat.layout == torch.sparse_coo else flat.values()
    if flat.is_complex():
        flat = flat.abs()
    return flat.reshape(-1)


def _reduce(pending: Pending, pos: int, flat: torch.Tensor, count_zeros: bool) -> None:
    """The per-tensor path: three reductions (min/max, sum, chunk norms) and the counts
    that are needed, kept in `pending`."""
    if flat.dtype not in _LOW_PRECISION:
        flat = flat.to(torch.float64)
    acc = torch.float32 if flat.dtype in _LOW_PRECISION else torch.float64
    numel = flat.numel()
    total = flat.sum(dtype=acc)
    zero, not_taken, no_zeros = _constants(flat.device)
    on_cpu = flat.device.type == "cpu"
    finite = on_cpu and math.isfinite(total)
    if finite:
        pending.counts += [zero, zero]
    else:
        pending.counts += [torch.isnan(flat).sum(), torch.isinf(flat).sum()]
    if flat.dtype == torch.float32 and numel > FOREACH_NUMEL:
        low, high = flat.amin(), flat.amax()  # two passes beat aminmax on long float32
    else:
        low, high = torch.aminmax(flat)
    if not count_zeros:
        pending.counts.append(not_taken)
    elif on_cpu and (low.item() > 0 or high.item() < 0):  # no zero possible: not counted (CPU: a free read)
        pending.counts.append(no_zeros)
    else:
        pending.counts.append(torch.count_nonzero(flat))
    pending.positions.append(pos)
    pending.extremes += [low, high]
    pending.sums.append(total)
    pending.chunk_norms.append(_chunk_norms(flat, acc))
    pending.numels.append(float(numel))


def _reduce_group(pending: Pending, positions: list[int], group: list[torch.Tensor], count_zeros: bool) -> None:
    """The multi-tensor path, for floating-point tensors of one dtype and device: one norm
    kernel for the group, a sum per tensor (no multi-tensor kernel for it), the extremes (see
    the module docstring), counts only where needed."""
    acc = torch.float32 if group[0].dtype in _LOW_PRECISION else torch.float64
    on_cpu = group[0].device.type == "cpu"
    if on_cpu:  # one aminmax a tensor: 1.4-3x cheaper here than the group's max and a min each
        lows, highs = (list(side) for side in zip(*(torch.aminmax(t) for t in group)))
    else:  # one launch for the maxima of the group
        highs = torch._foreach_max(group)
        lows = [t.amin() for t in group]
    norms = torch.stack(torch._foreach_norm(group, 2, dtype=acc)).to(torch.float64).view(-1, 1).unbind()
    sums = [t.sum(dtype=acc) for t in group]
    zero, not_taken, no_zeros = _constants(group[0].device)
    if on_cpu:  # one read for the group (no device queue on CPU)
        finite = torch.stack(sums).isfinite().tolist()
        signed = ((torch.stack(lows) > 0) | (torch.stack(highs) < 0)).tolist() if count_zeros else finite
    else:
        finite = signed = [False] * len(group)
    for t, is_finite, one_signed in zip(group, finite, signed):
        if is_finite:
            pending.counts += [zero, zero]
        else:
            pending.counts += [torch.isnan(t).sum(), torch.isinf(t).sum()]
        if not count_zeros:
            pending.counts.append(not_taken)
        else:  # all of one sign: no zero to count
            pending.counts.append(no_zeros if one_signed else torch.count_nonzero(t))
    pending.extremes += [value for pair in zip(lows, highs) for value in pair]
    pending.sums += sums
    pending.chunk_norms += norms
    pending.numels += [float(t.numel()) for t in group]
    pending.positions += positions


def _repeat(pending: Pending, pos: int, source: Pending, first: int) -> None:
    """Row `pos` of `pending` is the same tensor as the `first` row of `source`'s per-tensor path."""
    pending.positions.append(pos)
    pending.extremes += source.extremes[2 * first:2 * first + 2]
    pending.sums.append(source.sums[first])
    pending.chunk_norms.append(source.chunk_norms[first])
    pending.counts += source.counts[3 * first:3 * first + 3]
    pending.numels.append(source.numels[first])


@functools.lru_cache(maxsize=None)
def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """0-dim int64 tensors on `device`: a zero count; as a nonzero count, -1 for a count not
    taken and -2 for a tensor known to hold no zero (all its values of one sign)."""
    return (torch.zeros((), dtype=torch.int64, device=device),
            torch.full((), NOT_TAKEN, dtype=torch.int64, device=device),
            torch.full((), NO_ZEROS, dtype=torch.int64, device=device))


def _empty_rows(count: int, device: torch.device) -> torch.Tensor:
    rows = torch.zeros((count, N_BUILTIN), dtype=torch.float64, device=device)  # filled on the device: no copy
    for i, column in enumerate(BUILTIN):
        if column.identity:
            rows[:, i] = column.identity
    return rows


def _row(**named: torch.Tensor) -> torch.Tensor:
    """The built-in columns' vectors, by name, as rows in the registry's order (the order the C
    and Triton kernels write too: `columns.BUILTIN`)."""
    return torch.stack([named[column.name] for column in BUILTIN], dim=1)


def _host_values(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host-side numbers (lengths, an order) as a tensor on `device`; to an accelerator through
    pinned memory without blocking: a pageable host-to-device copy waits until the device's
    queue drains, which would put a host sync in every monitored step."""
    host = torch.as_tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def _chunk_norms(flat: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Norms of fixed-size chunks (in `acc` within a chunk; combined in `_pack`, in float64).
    A tensor shorter than a chunk is its own chunk norms: a float64 copy of its values."""
    numel = flat.numel()
    head = numel // NORM_CHUNK * NORM_CHUNK
    if head == 0:
        return flat.to(torch.float64, copy=True)
    if head == numel:
        return torch.linalg.vector_norm(flat.view(-1, NORM_CHUNK), dim=1, dtype=acc)
    chunks = torch.linalg.vector_norm(flat[:head].view(-1, NORM_CHUNK), dim=1, dtype=acc)
    return torch.cat([chunks, torch.linalg.vector_norm(flat[head:], dtype=acc).unsqueeze(0)])


def _small_rows(flats: list[torch.Tensor], count_zeros: bool) -> torch.Tensor:
    """Rows of tensors of similar length, reduced together as one zero-padded matrix (stacked,
    without padding, when their lengths are equal)."""
    device = flats[0].device
    numels = [f.numel() for f in flats]
    lengths = _host_values(numels, torch.float64, device)
    flats = [f if f.dtype != torch.bool else f.to(torch.uint8) for f in flats]
    if min(numels) == max(numels):
        padded = torch.stack(flats).to(torch.float64)
        low, high = padded.amin(1), padded.amax(1)  # measured (torch 2.13, CPU): faster than aminmax(dim=1)
    else:
        padded = pad_sequence(flats, batch_first=True).to(torch.float64)
        inside = torch.arange(padded.shape[1], device=device) < lengths.unsqueeze(1)
        low = torch.where(inside, padded, math.inf).amin(1)
        high = torch.where(inside, padded, -math.inf).amax(1)
    total = padded.sum(1)
    sumsq = (padded * padded).sum(1)
    if sumsq.device.type == "cpu" and math.isfinite(float(sumsq.sum())):
        nans = infs = torch.zeros_like(sumsq)
    else:
        nans, infs = torch.isnan(padded).sum(1), torch.isinf(padded).sum(1)
    zeros = lengths - torch.count_nonzero(padded, dim=1) if count_zeros else torch.full_like(total, _UNKNOWN)
    return _row(min=low, max=high, sum=total, sumsq=sumsq, nan_count=nans.to(torch.float64),
                inf_count=infs.to(torch.float64), zero_count=zeros.to(torch.float64), numel=lengths)


def _pack(pending: Pending) -> torch.Tensor:
    """The rows of the per-tensor path, from its results, in a dozen batched ops; each
    tensor's sum of squares is the float64 sum of its squared chunk norms."""
    low_high = _stack_f64(pending.extremes).view(-1, 2)
    counts = torch.stack(pending.counts).view(-1, 3).to(torch.float64)
    numel = _host_values(pending.numels, torch.float64, counts.device)
    chunk_norms = torch.cat(pending.chunk_norms).to(torch.float64)  # cat promotes float32 to float64
    lengths = _host_values([c.shape[0] for c in pending.chunk_norms], torch.int64, counts.device)
    sumsq = torch.segment_reduce(chunk_norms.square(), "sum", lengths=lengths)
    nonzero = counts[:, 2]
    zeros = torch.where(nonzero == NOT_TAKEN, _UNKNOWN, torch.where(nonzero == NO_ZEROS, 0.0, numel - nonzero))
    return _row(min=low_high[:, 0], max=low_high[:, 1], sum=_stack_f64(pending.sums), sumsq=sumsq,
                nan_count=counts[:, 0], inf_count=counts[:, 1], zero_count=zeros, numel=numel)


def _stack_f64(values: list[torch.Tensor]) -> torch.Tensor:
    """0-dim tensors of any dtypes as one float64 vector (one stack per dtype)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, value in enumerate(values):
        by_dtype.setdefault(value.dtype, []).append(i)
    if len(by_dtype) == 1:
        return torch.stack(values).to(torch.float64)
    out = torch.empty(len(values), dtype=torch.float64, device=values[0].device)
    for members in by_dtype.values():
        out[members] = torch.stack([values[i] for i in members]).to(torch.float64)
    return out


def to_host(rows: torch.Tensor):
    """The single device-to-host copy of a step's packed statistics (numpy float64)."""
    return rows.detach().to("cpu", torch.float64).numpy()


class HostCopy:
    """A device-to-host copy of packed rows started without waiting: into a pinned host
    buffer with ``non_blocking=True`` and an event recorded after it, on an accelerator;
    a plain copy on CPU (nothing to wait for, the path is the same)."""
    __slots__ = ("buffer", "event")

    def __init__(self, rows: torch.Tensor) -> None:
        rows = rows.detach().to(torch.float64)
        if rows.device.type == "cpu":
            self.buffer, self.event = rows.clone(), None
        else:
            self.buffer = torch.empty(rows.shape, dtype=torch.float64, pin_memory=True)
            self.buffer.copy_(rows, non_blocking=True)
            self.event = torch.Event(device=rows.device)
            self.event.record()

    def result(self) -> tuple[Any, bool]:
        """The rows (numpy float64), and whether the host had to wait for the copy (read a step
        later, it is long done: no wait)."""
        waited = self.event is not None and not self.event.query()
        if waited:
            self.event.synchronize()
        return self.buffer.numpy(), waited


def start_copy(rows: torch.Tensor) -> HostCopy:
    """Start the step's device-to-host copy without blocking; `HostCopy.result()` reads it."""
    return HostCopy(rows)


def on_accelerator(rows: torch.Tensor) -> bool:
    """Whether `rows` live on a device the host would wait for (not the CPU)."""
    return rows.device.type != "cpu"


def concat(rows: Sequence[Rows]) -> torch.Tensor:
    """Pack the step's row blocks (tensors or `Pending` blocks) into one tensor, on the first
    block's device; the per-tensor results of all the pending blocks are packed together."""
    device = rows[0].device if rows else torch.device("cpu")
    merged = Pending(0, device)
    for block in rows:
        if isinstance(block, Pending):
            merged.absorb(block)
        else:
            merged.add_rows(block)
    pieces = [(merged.positions, _pack(merged))] if merged.positions else []
    pieces += merged.blocks
    if not pieces:
        return torch.empty((0, columns.n_columns()), dtype=torch.float64, device=device)
    packed = torch.cat([rows.to(device) for _, rows in pieces])
    order = [pos for positions, _ in pieces for pos in positions]
    if order == list(range(len(order))):
        return packed
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return packed.index_select(0, _host_values(inverse, torch.long, device))


def pick(sources: Sequence[tuple[Rows, int]]) -> Pending:
    """Rows already measured, as a new deferred block: for each ``(block, pos)``, row `pos` of
    `block` (a block not yet packed, or rows); the per-tensor path's 0-dim results are shared,
    packed rows are sliced (views), nothing is reduced again."""
    picked = Pending(len(sources), sources[0][0].device)
    for i, (block, pos) in enumerate(sources):
        if not isinstance(block, Pending):
            picked.blocks.append(([i], block[pos:pos + 1]))
        elif pos in block.positions:
            _repeat(picked, i, block, block.positions.index(pos))
        else:
            positions, rows = next(b for b in block.blocks if pos in b[0])
            at = positions.index(pos)
            picked.blocks.append(([i], rows[at:at + 1]))
    return picked


def scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)
