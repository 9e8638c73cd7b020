"""Replicated activations measured by one tensor-parallel rank each, not by all of them.

Without sequence parallelism most of a Megatron layer's activations are the same tensor on every
TP rank (the outputs of row-parallel layers after their all-reduce, layer norms, the residual
stream): every rank measured the same bits and the merge took them once. `ReplicaSplit` learns
which rows those are from the first merged step (the rows the TP merge took as this rank measured
them, bit for bit: no collective of its own) and from then on hands each such row to one TP rank (by a checksum of
its key, the same on every rank); the others measure an empty tensor in its place, whose row is
the merge's identity. The TP merge of a row whose ranks measured different bits is the exact
merge (`GroupMerge`'s `auto`), so the merged row is the owner's row exactly, bit for bit, and
each rank measures about 1/TP of the replicated activations.

Rows of a constant tensor (min = max: e.g. the zeros of a zero-initialised partitioned layer,
alike on every rank by chance) are not learned as replicated. Not split: parameter rows (the optimizer reads them), rows that repeat an earlier row of the
micro-step (they follow that row), router rows and training scalars, and a replayed step's rows
(an incident's replay is not merged). A step Megatron's nan check rejects is written from this
rank's own rows (`MegatronMonitor._on_rejected`): there the rows other TP ranks own are empty.
"""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from msprobe_engine.reducer import Reducer
from msprobe_engine.stats.columns import P_MAX, P_MIN, P_NUMEL
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor

#: row kinds that may be split: activations, their gradients, the hidden inputs of incidents
SPLIT_KINDS = frozenset({"actv", "actv_grad", "actv_in", "actv_in_grad"})


class ReplicaSplit(Reducer):
    """The monitor's reducer (wrapping Megatron's `StatReducer`) and its `add_tensors` (wrapping
    the measurer's): see the module docstring. `install()` puts both in place."""

    def __init__(self, monitor: "Monitor", inner: Reducer, tp_group: object) -> None:
        self.monitor = monitor
        self.inner = inner
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.replays_together = inner.replays_together
        self.elsewhere: frozenset[MetricKey] = frozenset()  # replicated rows another TP rank measures
        self._learned = False
        self._add: Callable[..., None] = monitor.add_tensors

    def install(self) -> None:
        self.monitor.reducer = self
        self.monitor.add_tensors = self.add_tensors

    # ---- Reducer --------------------------------------------------------------------------
    def merge(self, keys: Sequence[MetricKey], rows: Any) -> Any:
        tp = getattr(self.inner, "tp", None)
        if self._learned or self.monitor.replaying or not callable(tp):
            return self.inner.merge(keys, rows)
        watched = _Watched(tp)
        self.inner.tp = watched
        try:
            merged = self.inner.merge(keys, rows)
        finally:
            self.inner.tp = tp
        if watched.seen:
            self._learn(keys, *watched.seen)
        return merged

    def agree(self, decision):
        return self.inner.agree(decision)

    def _learn(self, keys: Sequence[MetricKey], rows: torch.Tensor, merged: torch.Tensor) -> None:
        """The rows the TP merge took as they were (every rank measured the same bits), unless
        constant (all zeros from a zero-initialised partitioned layer are alike by chance)."""
        alike = (rows.view(torch.int64) == merged.view(torch.int64)).all(dim=1) & (rows[:, P_NUMEL] > 0)
        alike = (alike & (rows[:, P_MIN] < rows[:, P_MAX])).tolist()  # a constant tensor may be a coincidence
        self.elsewhere = frozenset(key for key, same in zip(keys, alike) if same and key.kind in SPLIT_KINDS
                                   and zlib.crc32("\t".join(key).encode()) % self.tp_size != self.tp_rank)
        self._learned = True

    # ---- add_tensors ----------------------------------------------------------------------
    def add_tensors(self, keys: Sequence[MetricKey], tensors: Sequence[Any], divisor: float = 1.0, *,
                    same: Sequence[MetricKey | None] = (), later: bool = False) -> None:
        elsewhere = self.elsewhere
        if elsewhere and not self.monitor.replaying:
            first = same or [None] * len(keys)
            tensors = [t.new_empty(0) if prior is None and key in elsewhere else t
                       for key, t, prior in zip(keys, tensors, first)]
        self._add(keys, tensors, divisor, same=same, later=later)


class _Watched:
    """A group merge that keeps the rows it was given and what it made of them; every other
    attribute (what a merge over the next group reads of it) is the wrapped merge's."""

    def __init__(self, merge: Callable[..., torch.Tensor]) -> None:
        self.merge = merge
        self.seen: tuple[torch.Tensor, torch.Tensor] | tuple[()] = ()

    def __call__(self, keys: Sequence[MetricKey], rows: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        merged = self.merge(keys, rows, *args, **kwargs)
        self.seen = (rows, merged)
        return merged

    def __getattr__(self, name: str) -> Any:
        return getattr(self.merge, name)
