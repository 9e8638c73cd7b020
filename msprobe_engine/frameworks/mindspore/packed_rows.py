"""Statistics of many small float32-family tensors with a handful of kernels, inside a compiled graph.

One kernel in a MindSpore CPU graph costs about 10 us, and `backend.stat_rows` spends about ten
per group of same-length tensors. Packed, the small tensors (at most `backend.PACK_NUMEL`
elements each) of a graph tap are flattened and concatenated once, gathered into one matrix of
`CHUNK`-element rows (each tensor's chunks aligned on its first element; the last chunk padded
with the tensor's first element, so min and max are unchanged, and masked to 0 for the sums and
counts), reduced along its rows, and the chunks' results combined per tensor: a gather for min and
max, a gather and a float64 sum for sums and counts. The chunks are those of `backend.sums`, so the
rows equal the per-group form's within float32 reordering. Compiled graph taps only
(`graph_optimizer`): `backend.partial_stats` keeps the per-group form.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

#: elements per row of the packed matrix (`backend.SUM_CHUNK`'s chunks)
CHUNK = 1 << 10


class Pack(NamedTuple):
    """Constants of the packed reduction of `members` tensors (the first ones a plan takes):
    `index` and `mask` ``[chunks, CHUNK]`` (where each element of the matrix comes from in the
    concatenated tensors; 0 at pads), `numels` float64 (their sizes), `owner` ``[members, most
    chunks]`` (each tensor's chunks, its last repeated) and `spread` (the same, padded with
    `chunks`: the index of an appended 0)."""
    members: int
    index: Tensor
    mask: Tensor
    numels: Tensor
    owner: Tensor
    spread: Tensor


def pack(sizes: Sequence[int]) -> Pack:
    """The `Pack` of tensors of `sizes` elements (each at least 1), in that order."""
    chunks = [-(-n // CHUNK) for n in sizes]
    total = sum(chunks)
    index = np.zeros((total, CHUNK), np.int32)
    mask = np.zeros((total, CHUNK), np.float32)
    owner = np.zeros((len(sizes), max(chunks)), np.int32)
    spread = np.full((len(sizes), max(chunks)), total, np.int32)
    row = offset = 0
    for i, (numel, count) in enumerate(zip(sizes, chunks)):
        position = np.arange(count * CHUNK)
        inside = position < numel
        index[row:row + count] = (offset + np.where(inside, position, 0)).reshape(count, CHUNK)
        mask[row:row + count] = inside.reshape(count, CHUNK)
        owner[i] = row + np.minimum(np.arange(owner.shape[1]), count - 1)
        spread[i, :count] = row + np.arange(count)
        row, offset = row + count, offset + numel
    return Pack(len(sizes), Tensor(index), Tensor(mask), Tensor(np.array(sizes, np.float64)), Tensor(owner),
                Tensor(spread))


def packed_matrix(flats, constants):
    """The ``[chunks, CHUNK]`` matrix of the 1-D float32 tensors `flats` (as `constants` says)."""
    return ops.gather(ops.cat(flats) if len(flats) > 1 else flats[0], constants.index, 0)


def packed_stats(matrix, constants):
    """(min, max, sum, sum of squares) per packed tensor (float32 vectors, sums chunked in float64)."""
    low, high = ops.aminmax(matrix, axis=1)
    masked = matrix * constants.mask
    sums = _per_tensor(ops.stack([masked.sum(1), (masked * masked).sum(1)], 1), constants).astype(ms.float32)
    return (ops.gather(low, constants.owner, 0).min(1), ops.gather(high, constants.owner, 0).max(1),
            sums[:, 0], sums[:, 1])


def packed_counts(test, matrix, constants):
    """Per packed tensor, how many elements pass `test` (exact), int32."""
    per_chunk = (test(matrix).astype(ms.float32) * constants.mask).sum(1)
    return _per_tensor(per_chunk.reshape(-1, 1), constants).reshape(-1).astype(ms.int32)


def _per_tensor(per_chunk, constants):
    """``[members, k]`` float64: the sums of each tensor's rows of ``[chunks, k]`` `per_chunk`
    (a gather, not a matrix product: a nan in one tensor's chunk stays there)."""
    padded = ops.cat([per_chunk.astype(ms.float64), ops.zeros((1, per_chunk.shape[1]), ms.float64)])
    return ops.gather(padded, constants.spread, 0).sum(1)
