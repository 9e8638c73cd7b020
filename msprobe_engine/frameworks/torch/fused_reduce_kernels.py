"""The Triton kernels of `fused_reduce` (this module imports Triton; `fused_reduce` imports it
only on first use). See `fused_reduce` for what they compute and how they are launched."""
import torch
import triton
import triton.language as tl


@triton.jit
def accumulate(x, inside, low, high, total, squares, nans, infs, zeros):
    x = x.to(tl.float32)
    is_nan = x != x
    low = tl.minimum(low, tl.where(inside & ~is_nan, x, float("inf")))
    high = tl.maximum(high, tl.where(inside & ~is_nan, x, float("-inf")))
    total += x
    squares += x * x
    nans += is_nan.to(tl.int32)
    infs += (tl.abs(x) == float("inf")).to(tl.int32)
    zeros += (inside & (x == 0.0)).to(tl.int32)
    return low, high, total, squares, nans, infs, zeros


@triton.jit(do_not_specialize=["n_tensors", "search_steps"])  # no recompiling for a count of 1
def segment_kernel(table, n_tensors, search_steps, partials, DTYPE: tl.constexpr, SEGMENT: tl.constexpr,
                   BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """One program per segment. `table`: the tensors' addresses [n_tensors], lengths [n_tensors]
    and first segments [n_tensors + 1] (int64); the program finds its tensor by a binary search
    of the first segments (`search_steps` = ceil(log2(n_tensors)) halvings)."""
    seg = tl.program_id(0)
    starts = table + 2 * n_tensors
    low_t = 0
    high_t = n_tensors  # starts[low_t] <= seg < starts[high_t]
    for _ in range(search_steps):
        mid = (low_t + high_t) // 2
        right = tl.load(starts + mid) <= seg
        low_t = tl.where(right, mid, low_t)
        high_t = tl.where(right, high_t, mid)
    within = seg - tl.load(starts + low_t)
    numel = tl.load(table + n_tensors + low_t)
    length = tl.minimum(numel - within.to(tl.int64) * SEGMENT, SEGMENT)
    base = tl.load(table + low_t).to(tl.pointer_type(DTYPE))
    if ALIGNED:  # every tensor's address a multiple of 16 bytes (checked on the host): vector loads
        base = tl.multiple_of(base, 16)
    base += within.to(tl.int64) * SEGMENT
    lanes = tl.arange(0, BLOCK)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    high = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    squares = tl.zeros([BLOCK], tl.float32)
    nans = tl.zeros([BLOCK], tl.int32)
    infs = tl.zeros([BLOCK], tl.int32)
    zeros = tl.zeros([BLOCK], tl.int32)
    full = length // BLOCK * BLOCK
    everywhere = lanes < BLOCK
    for start in range(0, full, BLOCK):  # whole blocks: loads without a mask
        x = tl.load(base + tl.multiple_of(start, BLOCK) + lanes)
        low, high, total, squares, nans, infs, zeros = accumulate(
            x, everywhere, low, high, total, squares, nans, infs, zeros)
    if full < length:  # the tail, masked
        inside = full + lanes < length
        x = tl.load(base + full + lanes, mask=inside, other=0.0)
        low, high, total, squares, nans, infs, zeros = accumulate(
            x, inside, low, high, total, squares, nans, infs, zeros)
    row = partials + seg * 8
    tl.store(row + 0, tl.min(low, axis=0).to(tl.float64))
    tl.store(row + 1, tl.max(high, axis=0).to(tl.float64))
    tl.store(row + 2, tl.sum(total, axis=0).to(tl.float64))
    tl.store(row + 3, tl.sum(squares, axis=0).to(tl.float64))
    tl.store(row + 4, tl.sum(nans, axis=0).to(tl.float64))
    tl.store(row + 5, tl.sum(infs, axis=0).to(tl.float64))
    tl.store(row + 6, tl.sum(zeros, axis=0).to(tl.float64))
    tl.store(row + 7, length.to(tl.float64))


@triton.jit
def combine_kernel(partials, starts, rows, COUNT_ZEROS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    first = tl.load(starts + t)
    end = tl.load(starts + t + 1)
    lanes = tl.arange(0, BLOCK)
    low = tl.full([BLOCK], float("inf"), tl.float64)
    high = tl.full([BLOCK], float("-inf"), tl.float64)
    total = tl.zeros([BLOCK], tl.float64)
    squares = tl.zeros([BLOCK], tl.float64)
    nans = tl.zeros([BLOCK], tl.float64)
    infs = tl.zeros([BLOCK], tl.float64)
    zeros = tl.zeros([BLOCK], tl.float64)
    numel = tl.zeros([BLOCK], tl.float64)
    for at in range(first, end, BLOCK):
        seg = at + lanes
        inside = seg < end
        row = partials + seg * 8
        low = tl.minimum(low, tl.load(row + 0, mask=inside, other=float("inf")))
        high = tl.maximum(high, tl.load(row + 1, mask=inside, other=float("-inf")))
        total += tl.load(row + 2, mask=inside, other=0.0)
        squares += tl.load(row + 3, mask=inside, other=0.0)
        nans += tl.load(row + 4, mask=inside, other=0.0)
        infs += tl.load(row + 5, mask=inside, other=0.0)
        zeros += tl.load(row + 6, mask=inside, other=0.0)
        numel += tl.load(row + 7, mask=inside, other=0.0)
    nan_count = tl.sum(nans, axis=0)
    count = tl.sum(numel, axis=0)
    nan = float("nan")
    out = rows + t * 8
    tl.store(out + 0, tl.where(nan_count > 0, nan, tl.min(low, axis=0)))
    tl.store(out + 1, tl.where(nan_count > 0, nan, tl.max(high, axis=0)))
    tl.store(out + 2, tl.sum(total, axis=0))
    tl.store(out + 3, tl.sum(squares, axis=0))
    tl.store(out + 4, nan_count)
    tl.store(out + 5, tl.sum(infs, axis=0))
    if COUNT_ZEROS:
        tl.store(out + 6, tl.sum(zeros, axis=0))
    else:
        tl.store(out + 6, tl.where(count > 0, nan, 0.0))
    tl.store(out + 7, count)


#: torch dtype -> the Triton element type the segment kernel reads
DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
