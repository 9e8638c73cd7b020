"""Batched partial statistics of many torch tensors, on their own device.

Small tensors are concatenated into one float64 buffer and reduced with
segment reductions (about ten kernel launches for all of them); large
tensors are reduced one by one with torch's vectorised reductions, whose
per-call overhead is negligible next to their size. Floating-point tensors
are accumulated in float32 (bf16/fp16/fp32) or float64 (float64), never
copied to float64 when large. Integer and bool tensors are converted to
float64.
"""
from __future__ import annotations

from typing import Sequence

import torch

#: Tensors up to this many elements are batched into one concatenated buffer.
SMALL_NUMEL = 1 << 15
#: Large tensors' squares are summed in float32 per chunk of this many elements,
#: and the chunk sums in float64 (relative error about 1e-7 instead of 1e-4).
NORM_CHUNK = 4096

_LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32)


def partial_stats(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Return a ``[len(tensors), 8]`` float64 tensor of partial statistics.

    Columns follow `msprobe_engine.stats.PARTIAL_COLUMNS`. The result lives on
    the device of the first tensor; nothing is transferred to the host.
    """
    if not tensors:
        return torch.empty((0, 8), dtype=torch.float64)
    device = tensors[0].device
    small_pos: list[int] = []
    small: list[torch.Tensor] = []
    pieces: list[torch.Tensor] = []
    order: list[int] = []
    for pos, tensor in enumerate(tensors):
        flat = tensor.detach().reshape(-1)
        numel = flat.numel()
        if numel == 0:
            pieces.append(_empty_row(device))
            order.append(pos)
        elif numel <= SMALL_NUMEL:
            small_pos.append(pos)
            small.append(flat)
        else:
            pieces.append(_large_row(flat).to(device))
            order.append(pos)
    if small:
        pieces.append(_small_rows(small).to(device))
        order.extend(small_pos)
    rows = torch.cat(pieces)
    if order == list(range(len(tensors))):
        return rows
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return rows.index_select(0, inverse.to(device))


def _empty_row(device: torch.device) -> torch.Tensor:
    inf = float("inf")
    return torch.tensor([[inf, -inf, 0, 0, 0, 0, 0, 0]], dtype=torch.float64, device=device)


def _large_row(flat: torch.Tensor) -> torch.Tensor:
    if flat.dtype in _LOW_PRECISION:
        acc = torch.float32
    else:
        flat = flat.to(torch.float64)
        acc = torch.float64
    low, high = torch.aminmax(flat)
    total = flat.sum(dtype=acc)
    sumsq = _sum_of_squares(flat, acc)
    nans = torch.isnan(flat).sum()
    infs = torch.isinf(flat).sum()
    nonzero = torch.count_nonzero(flat)
    numel = flat.numel()
    row = torch.stack([
        low.to(torch.float64), high.to(torch.float64), total.to(torch.float64),
        sumsq, nans.to(torch.float64), infs.to(torch.float64),
        numel - nonzero.to(torch.float64), torch.full((), numel, dtype=torch.float64, device=flat.device),
    ])
    return row.unsqueeze(0)


def _sum_of_squares(flat: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Sum of squares in float64, from float32 norms of fixed-size chunks (no float64 copy)."""
    head = flat.numel() // NORM_CHUNK * NORM_CHUNK
    chunks = torch.linalg.vector_norm(flat[:head].view(-1, NORM_CHUNK), dim=1, dtype=acc)
    tail = torch.linalg.vector_norm(flat[head:], dtype=acc)
    return chunks.to(torch.float64).square().sum() + tail.to(torch.float64).square()


def _small_rows(flats: list[torch.Tensor]) -> torch.Tensor:
    device = flats[0].device
    lengths_list = [f.numel() for f in flats]
    total = sum(lengths_list)
    values = torch.empty(total, dtype=torch.float64, device=device)
    torch.cat([f if f.dtype != torch.bool else f.to(torch.uint8) for f in flats], out=values)
    lengths = torch.tensor(lengths_list, dtype=torch.long, device=device)

    def seg(data: torch.Tensor, how: str) -> torch.Tensor:
        return torch.segment_reduce(data, how, lengths=lengths, unsafe=True)

    return torch.stack([
        seg(values, "min"),
        seg(values, "max"),
        seg(values, "sum"),
        seg(values * values, "sum"),
        seg(torch.isnan(values).to(torch.float64), "sum"),
        seg(torch.isinf(values).to(torch.float64), "sum"),
        seg((values == 0).to(torch.float64), "sum"),
        lengths.to(torch.float64),
    ], dim=1)


def to_host(rows: torch.Tensor):
    """The single device-to-host copy of a step's packed statistics (numpy float64)."""
    return rows.detach().to("cpu", torch.float64).numpy()


def concat(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Pack the step's row blocks into one tensor (on the first block's device)."""
    device = rows[0].device
    return torch.cat([r.to(device) for r in rows])


def scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)
