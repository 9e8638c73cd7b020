"""A tensor's partial row measured by the C kernel behind a registered op, opaque to inductor.

Inside a compiled graph, inductor fuses an in-graph reduction with the kernel that produces its
tensor. For some producers that costs more than it saves: with Llama's rotary-embedding backward
it recomputed `sin`/`cos` with gathered loads inside the reduction loop (3.6 ms a call instead of
0.15-0.6 ms). `msprobe::cpu_row` is a `torch.library` op (a fake implementation for tracing):
inductor cannot look into it, so it materialises the tensor once (it does anyway, for its other
consumers) and the op reads it with `cpu_reduce` at memory speed. Used for the rows of
activations and of their gradients (`compiled_hooks.CompiledCapture`) of CPU tensors the
kernel reads, of at least `MIN_NUMEL` values (below, the fused reduction costs less than the
op's call); which way a tensor goes is decided while tracing, a constant of the graph.
"""
from __future__ import annotations

import torch

from msprobe_engine.frameworks.torch import cpu_reduce
from msprobe_engine.stats import columns

#: the fewest values of a tensor measured by the op (smaller ones are reduced in the graph; 1 << 12
#: rather than 1 << 16 took llama-1m's compiled full.yaml from 1.75-1.85 to 1.60-1.64, gpt2-1m unchanged)
MIN_NUMEL = 1 << 12
_WIDTH = 8  # the kernel's row: the built-in columns


#: `msprobe::cpu_row`, defined on a `torch.library.Library` with a CPU kernel of its own rather than by
#: `torch.library.custom_op`, whose Python layers doubled the call's cost (14 against 7 us a call of a
#: 4096-value tensor; the kernel's own call 3.5 us)
_LIBRARY = torch.library.Library("msprobe", "FRAGMENT")
_LIBRARY.define("cpu_row(Tensor tensor, bool count_zeros) -> Tensor")


def _cpu_row(tensor: torch.Tensor, count_zeros: bool) -> torch.Tensor:
    """The float64 row (`columns` order) of a CPU tensor, by the C kernel."""
    return cpu_reduce.row(tensor, count_zeros)


_LIBRARY.impl("cpu_row", _cpu_row, "CPU")


@torch.library.register_fake("msprobe::cpu_row", lib=_LIBRARY)
def _(tensor: torch.Tensor, count_zeros: bool) -> torch.Tensor:
    return tensor.new_empty(_WIDTH, dtype=torch.float64)


cpu_row = torch.ops.msprobe.cpu_row.default


@torch.compiler.assume_constant_result
def _fits(numel: int, dtype: torch.dtype) -> bool:
    """Whether the kernel measures a CPU tensor of `numel` values of `dtype` (runs while tracing
    only: its result is a constant of the graph)."""
    return (numel >= MIN_NUMEL and dtype in cpu_reduce.DTYPES and columns.n_columns() == _WIDTH
            and not (torch.get_num_threads() > 1 and numel > cpu_reduce.PARALLEL_NUMEL)
            and cpu_reduce.ENABLED and cpu_reduce.available())


def usable(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s row is measured by `cpu_row` (a static-shaped CPU tensor the kernel reads)."""
    numel = tensor.numel()
    return tensor.is_cpu and isinstance(numel, int) and _fits(numel, tensor.dtype)


def values(tensor: torch.Tensor, count_zeros: bool) -> dict[str, torch.Tensor]:
    """`compiled_hooks.partial_values` of `tensor`, from `cpu_row`."""
    row = cpu_row(tensor.detach(), count_zeros)
    return {c.name: row[i] for i, c in enumerate(columns.columns())
            if count_zeros or c.name != "zero_count"}
