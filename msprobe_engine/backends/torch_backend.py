"""Batched partial statistics of many torch tensors, on their own device.

Small tensors are grouped by size class (lengths within a factor of two),
padded into one matrix per class and reduced along its rows: about a dozen
kernel launches per class for all of them. Large tensors are reduced one by
one with torch's vectorised reductions, whose per-call overhead is small next
to their size. Floating-point tensors are accumulated in float32
(bf16/fp16/fp32; the sum of squares per chunk of NORM_CHUNK elements, the
chunks in float64) or float64 (float64); large tensors are never copied to
float64. Small ones and integer/bool tensors are converted to float64.

nan/inf counting costs two extra passes over the data. On CPU tensors, where
reading a scalar stalls no device queue, the counts are taken only when the
sum of squares is not finite (a finite sum of squares proves there is no nan
or inf); on accelerators they are always counted on the device, with no
host synchronisation. The zero count (for `zero_frac`) is only taken on request.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

#: Tensors up to this many elements are batched by size class into padded matrices
#: (measured on CPU: above ~2k elements three vectorised reductions per tensor are cheaper).
SMALL_NUMEL = 2048
#: Large tensors' squares are summed in float32 per chunk of this many elements,
#: and the chunk sums in float64 (relative error about 1e-7 instead of 1e-4).
NORM_CHUNK = 4096

#: A size class of small tensors is padded into one matrix only when it has this many
#: members; fewer go through the per-tensor path (cheaper below that).
MIN_BATCH = 4

_LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32)
_UNKNOWN = float("nan")


def partial_stats(tensors: Sequence[torch.Tensor], count_zeros: bool = False) -> torch.Tensor:
    """Return a ``[len(tensors), 8]`` float64 tensor of partial statistics.

    Columns follow `msprobe_engine.stats.PARTIAL_COLUMNS`; the zero count is nan
    unless `count_zeros`. The result lives on the device of the first tensor;
    nothing is transferred to the host.
    """
    if not tensors:
        return torch.empty((0, 8), dtype=torch.float64)
    device = tensors[0].device
    pieces: list[torch.Tensor] = []
    order: list[int] = []
    groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    for pos, tensor in enumerate(tensors):
        flat = tensor.detach().reshape(-1)
        numel = flat.numel()
        if numel == 0:
            key: tuple = ("empty",)
        elif numel <= SMALL_NUMEL:
            key = ("small", numel.bit_length(), flat.device)
        else:
            key = ("large", flat.device)
        groups.setdefault(key, []).append((pos, flat))
    for key in [k for k, members in groups.items() if k[0] == "small" and len(members) < MIN_BATCH]:
        groups.setdefault(("large", key[2]), []).extend(groups.pop(key))
    for key, members in groups.items():
        flats = [flat for _, flat in members]
        if key[0] == "empty":
            rows = _empty_rows(len(flats), device)
        elif key[0] == "small":
            rows = _small_rows(flats, count_zeros)
        else:
            rows = _large_rows(flats, count_zeros)
        pieces.append(rows.to(device))
        order.extend(pos for pos, _ in members)
    rows = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if order == list(range(len(tensors))):
        return rows
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return rows.index_select(0, inverse.to(device))


def _empty_rows(count: int, device: torch.device) -> torch.Tensor:
    inf = float("inf")
    return torch.tensor([[inf, -inf, 0, 0, 0, 0, 0, 0]] * count, dtype=torch.float64, device=device)


def _large_rows(flats: list[torch.Tensor], count_zeros: bool) -> torch.Tensor:
    """Four reductions per tensor (min/max, sum, chunked norms, their float64 norm);
    the per-tensor scalars are then assembled with a handful of batched ops."""
    scalars, norms = [], []
    for i, flat in enumerate(flats):
        if flat.dtype not in _LOW_PRECISION:
            flat = flats[i] = flat.to(torch.float64)
        acc = torch.float32 if flat.dtype in _LOW_PRECISION else torch.float64
        low, high = torch.aminmax(flat)
        scalars += [low.to(acc), high.to(acc), flat.sum(dtype=acc)]
        norms.append(torch.linalg.vector_norm(_chunk_norms(flat, acc), dtype=torch.float64))
    count = len(flats)
    low_high_sum = (torch.stack(scalars) if _same_dtype(scalars) else
                    torch.stack([s.to(torch.float64) for s in scalars])).to(torch.float64).view(count, 3)
    sumsq = torch.stack(norms).square()
    nans, infs = _non_finite_counts(flats, sumsq)
    numel = [float(f.numel()) for f in flats]
    if count_zeros:
        zeros = torch.tensor(numel, dtype=torch.float64, device=sumsq.device) - torch.stack(
            [torch.count_nonzero(f) for f in flats]).to(torch.float64)
    else:
        zeros = torch.full_like(sumsq, _UNKNOWN)
    tail = torch.tensor(numel, dtype=torch.float64, device=sumsq.device).unsqueeze(1)
    return torch.cat([low_high_sum, sumsq.unsqueeze(1), nans.unsqueeze(1), infs.unsqueeze(1),
                      zeros.unsqueeze(1), tail], dim=1)


def _same_dtype(scalars: list[torch.Tensor]) -> bool:
    return all(s.dtype == scalars[0].dtype for s in scalars)


def _chunk_norms(flat: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Norms of fixed-size chunks (float32 within a chunk; combined later in float64)."""
    head = flat.numel() // NORM_CHUNK * NORM_CHUNK
    if head == 0:
        return flat
    chunks = torch.linalg.vector_norm(flat[:head].view(-1, NORM_CHUNK), dim=1, dtype=acc)
    if head == flat.numel():
        return chunks
    return torch.cat([chunks, torch.linalg.vector_norm(flat[head:], dtype=acc).unsqueeze(0)])


def _non_finite_counts(flats: list[torch.Tensor], sumsq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nan and inf counts per tensor; on CPU only for the tensors whose sum of squares is not finite."""
    if sumsq.device.type == "cpu":
        nans, infs = torch.zeros_like(sumsq), torch.zeros_like(sumsq)
        for i in torch.nonzero(~torch.isfinite(sumsq)).flatten().tolist():
            nans[i], infs[i] = torch.isnan(flats[i]).sum(), torch.isinf(flats[i]).sum()
        return nans, infs
    nans = torch.stack([torch.isnan(f).sum() for f in flats]).to(torch.float64)
    infs = torch.stack([torch.isinf(f).sum() for f in flats]).to(torch.float64)
    return nans, infs


def _small_rows(flats: list[torch.Tensor], count_zeros: bool) -> torch.Tensor:
    """Rows of tensors of similar length, reduced together as one zero-padded matrix."""
    device = flats[0].device
    lengths = torch.tensor([f.numel() for f in flats], dtype=torch.float64, device=device)
    padded = pad_sequence([f if f.dtype != torch.bool else f.to(torch.uint8) for f in flats],
                          batch_first=True).to(torch.float64)
    width = padded.shape[1]
    inside = torch.arange(width, device=device) < lengths.unsqueeze(1)
    total = padded.sum(1)
    sumsq = (padded * padded).sum(1)
    if sumsq.device.type == "cpu" and math.isfinite(float(sumsq.sum())):
        nans = infs = torch.zeros_like(sumsq)
    else:
        nans, infs = torch.isnan(padded).sum(1), torch.isinf(padded).sum(1)
    zeros = lengths - torch.count_nonzero(padded, dim=1) if count_zeros else torch.full_like(total, _UNKNOWN)
    return torch.stack([
        -torch.where(inside, -padded, -math.inf).amax(1),  # amax: amin along rows is 5x slower on CPU
        torch.where(inside, padded, -math.inf).amax(1),
        total, sumsq, nans.to(torch.float64), infs.to(torch.float64), zeros.to(torch.float64), lengths,
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
