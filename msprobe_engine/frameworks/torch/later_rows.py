"""Forward hooks' CPU tensors measured together: one C kernel call per micro-step, not one per hook.

A hook's tensors that the C kernel reads (`cpu_reduce.eligible`) are noted with their address,
length, dtype code and in-place version counter; their rows are views into a buffer that one
kernel call fills at `settle` (the root module's forward end, the next micro-step's begin, or
any read of the step's rows: `StepRows`), for all of them at once. Per hook call this leaves a
few list appends where the measuring chain (`partial_stats`, `cpu_reduce.measure`, a kernel call
and a row allocation) was.

Exactness: a tensor changed after its hook (an in-place op moves its version counter; values put
under it, ``t.data = ...``, move its address) has lost the values its hook saw. So a key is
measured at its hook, as without batching, until a settle found its tensor unchanged (its first
monitored micro-step); a key found changed is measured at its hook from then on. A key proven
unchanged whose tensor is found changed later (a code path that varies with the data) is
measured as it is at the settle, with a warning naming it, and at its hook from then on.
Changes through a tensor that does not share the version counter (another tensor's ``.data``
on the same storage) are not seen, as for the row reuse of `flow.TensorFlow`.
"""
from __future__ import annotations

import array
import logging
from typing import Hashable, Optional, Sequence

import torch

from msprobe_engine.frameworks.torch import cpu_reduce
from msprobe_engine.stats import columns

log = logging.getLogger("msprobe_engine")

#: rows per buffer: a buffer full is settled at once (bounds what the batch keeps alive)
CHUNK = 512


class LaterRows:
    """The tensors waiting for `settle`, and which keys may wait (see the module docstring)."""

    def __init__(self, count_zeros: bool) -> None:
        self.count_zeros = count_zeros
        self.proven: set[Hashable] = set()  # keys found unchanged at a settle: they may wait
        self.changed: set[Hashable] = set()  # keys found changed after their hook: measured at once
        self._waiting: list[tuple[Hashable, torch.Tensor, int]] = []  # (key, tensor, version)
        self._table: tuple[list[int], list[int], list[int]] = ([], [], [])  # addresses, lengths, dtype codes
        self._watched: list[tuple[Hashable, torch.Tensor, int, int]] = []  # keys on probation, measured at once
        self._buffer: Optional[torch.Tensor] = None

    def add(self, keys: Sequence[Hashable], tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        """The rows of `tensors` (named by `keys`), filled at the next settle; None: measure them
        now (a key not proven yet, which is then watched, a tensor the kernel does not read, or
        registered columns, which only the torch path measures)."""
        if columns.EXTRA:
            return None
        if not self.proven.issuperset(keys):
            self._watch(keys, tensors)
            return None
        if not (cpu_reduce.ENABLED and cpu_reduce.available()):
            return None
        parallel = torch.get_num_threads() > 1
        eligible = cpu_reduce.eligible
        if not all([eligible(t, parallel) for t in tensors]):
            return None
        try:
            versions = [t._version for t in tensors]
        except RuntimeError:  # an inference tensor: no version counter to check
            return None
        used = len(self._waiting)
        if self._buffer is None or used + len(tensors) > len(self._buffer):
            self.settle()
            used = 0
            self._buffer = torch.empty(max(CHUNK, len(tensors)), 8, dtype=torch.float64)
        addresses, lengths, codes = self._table
        waiting, dtypes = self._waiting, cpu_reduce.DTYPES
        for key, t, now in zip(keys, tensors, versions):
            if not t.is_contiguous():
                with torch.no_grad():
                    t = t.contiguous()  # a copy of its own: nothing changes it
            waiting.append((key, t, now))
            addresses.append(t.data_ptr())
            lengths.append(t.numel())
            codes.append(dtypes[t.dtype])
        return self._buffer[used:used + len(tensors)]

    def _watch(self, keys: Sequence[Hashable], tensors: Sequence[torch.Tensor]) -> None:
        """Note the unproven keys' tensors (measured now), to see at the settle whether they changed."""
        changed = self.changed
        for key, t in zip(keys, tensors):
            if key not in changed:
                try:
                    self._watched.append((key, t, t._version, t.data_ptr()))
                except RuntimeError:  # an inference tensor: never proven
                    changed.add(key)

    def settle(self) -> None:
        """Measure the waiting tensors (one kernel call) and learn from the watched ones."""
        for key, t, before, address in self._watched:
            if t._version == before and t.data_ptr() == address:
                self.proven.add(key)
            else:
                self.changed.add(key)
        self._watched = []
        if not self._waiting:
            return
        waiting, (addresses, lengths, codes) = self._waiting, self._table
        self._waiting, self._table = [], ([], [], [])
        for i, (key, t, before) in enumerate(waiting):
            if t._version != before or t.data_ptr() != addresses[i] or t.numel() != lengths[i]:
                self._changed(key)
                if not t.is_contiguous():
                    with torch.no_grad():
                        t = t.contiguous()
                        waiting[i] = (key, t, before)  # alive during the call
                addresses[i], lengths[i], codes[i] = t.data_ptr(), t.numel(), cpu_reduce.DTYPES.get(t.dtype, -1)
            try:
                cpu_reduce.check_storage(t)
                if codes[i] < 0:
                    raise ValueError(f"its dtype is now {t.dtype}")
            except ValueError as exc:  # freed or retyped under it: the empty row (the merge's identity)
                log.warning("msprobe: %s not measured: %s", key, exc)
                addresses[i], lengths[i], codes[i] = 0, 0, 0
        out = self._buffer
        self._buffer = None  # the next rows go to a new buffer: these rows' views keep this one
        table = array.array("q", [*addresses, *lengths, *codes])
        cpu_reduce.fill_rows(len(waiting), table, self.count_zeros, out)

    def _changed(self, key: Hashable) -> None:
        log.warning("msprobe: %s changed after its hook (in place) in a later micro-step than its first: "
                    "measured as it is at the micro-step's end this time, at its hook from now on", key)
        self.proven.discard(key)
        self.changed.add(key)
