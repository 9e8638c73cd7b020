"""Measuring a step's tensors on their device: the rows wait for the step's one host transfer."""
from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Sequence

from msprobe_engine.control import ControlFile
from msprobe_engine.stats import divide
from msprobe_engine.stats.table import MetricKey
from msprobe_engine.steps.clock import StepClock
from msprobe_engine.steps.pipeline import StepPipeline


class Measurer:
    """Hands tensors to the backend and their rows to `pipeline.rows`. `find_backend(tensor)`
    sets the pipeline's backend when none is known yet; `tensor_meta` (None: incidents off)
    gets (dtype, shape, requires_grad) of each tensor measured, by key."""

    def __init__(self, clock: StepClock, pipeline: StepPipeline, control: ControlFile | None, count_zeros: bool,
                 tensor_meta: dict[MetricKey, tuple] | None, find_backend: Callable[[Any], None]) -> None:
        self.clock = clock
        self.pipeline = pipeline
        self.control = control
        self.count_zeros = count_zeros
        self.tensor_meta = tensor_meta
        self.find_backend = find_backend

    def add(self, keys: Sequence[MetricKey], tensors: Sequence[Any], divisor: float = 1.0, *,
            same: Sequence[MetricKey | None] = (), later: bool = False) -> None:
        """`Monitor.add_tensors` (see `contract.StepLifecycle.add_tensors`)."""
        if not (self.clock.active and tensors):
            return
        rows_waiting = self.pipeline.rows
        if self.control is not None and self.control.current.muted:
            keys, tensors, same = self.control.unmuted(keys, tensors, same, rows_waiting.last)
            if not tensors:
                return
        if self.pipeline.backend is None:
            self.find_backend(tensors[0])
        backend, started = self.pipeline.backend, time.perf_counter()
        measured = [t for t, prior in zip(tensors, same) if prior is None] if same else tensors
        own_keys = [key for key, prior in zip(keys, same) if prior is None] if same else keys
        plain = not hasattr(divisor, "shape") and divisor == 1.0
        rows = None
        if measured and later and plain:  # measured at the micro-step's end (`StepRows.later`), if it may wait
            rows = self._later(backend, own_keys, measured)
        if rows is None and measured:
            rows = backend.partial_stats(measured, count_zeros=self.count_zeros, deferred=plain)
            if not plain:  # otherwise packed into rows with the step's others, at the transfer
                rows = divide(rows, divisor)
        if len(measured) < len(tensors):
            own = dict(zip(own_keys, zip(itertools.repeat(rows), itertools.count())))
            rows = backend.pick([own[key] if prior is None else own.get(prior) or rows_waiting.last[prior]
                                 for key, prior in zip(keys, same)])
        self._record(keys, tensors, rows, started, remember=bool(same), measured=len(measured))

    def add_differences(self, keys: Sequence[MetricKey], after: Sequence[Any], before: Sequence[Any]) -> None:
        """`Monitor.add_differences`: the rows of ``after[i] - before[i]`` under `keys`, by the
        backend's `difference_stats` (the torch backend on CPU: the differences never written)."""
        if not (self.clock.active and after):
            return
        if self.control is not None and self.control.current.muted:
            keys, pairs, _ = self.control.unmuted(keys, list(zip(after, before)), (), {})
            if not pairs:
                return
            after, before = [a for a, _ in pairs], [b for _, b in pairs]
        if self.pipeline.backend is None:
            self.find_backend(after[0])
        started = time.perf_counter()
        rows = self.pipeline.backend.difference_stats(after, before, count_zeros=self.count_zeros, deferred=True)
        self._record(keys, after, rows, started, remember=False, measured=len(after))

    def _record(self, keys: Sequence[MetricKey], tensors: Sequence[Any], rows: Any, started: float, *,
                remember: bool, measured: int) -> None:
        """Hand `rows` (measured since `started`) to the step's waiting rows; the tensors' meta (an
        incident's dump.json) kept by key."""
        if self.tensor_meta is not None:
            backend = self.pipeline.backend
            self.tensor_meta.update(zip(keys, map(getattr(backend, "tensor_meta", tensor_meta), tensors)))
        self.pipeline.rows.add(self.clock.step, keys, rows, remember=remember, seconds=time.perf_counter() - started,
                               measured=measured)

    def _later(self, backend: Any, keys: Sequence[MetricKey], tensors: Sequence[Any]) -> Any:
        """Rows that the backend's `LaterRows` fills at the micro-step's end, or None: measure now."""
        batch = self.pipeline.rows.later
        if batch is None:  # the backend's batch, made on first use (False: it has none)
            make = getattr(backend, "LaterRows", None)
            batch = self.pipeline.rows.later = make(self.count_zeros) if make is not None else False
        return batch.add(keys, tensors) if batch else None

    def scalar(self, value: Any) -> Any:
        """A training scalar (a tensor or a number) as something the backend measures."""
        if hasattr(value, "shape"):
            return value
        value = float(value)
        if self.pipeline.backend is None:  # no framework seen yet: the number is measured on the host
            self.find_backend(value)
        return self.pipeline.backend.scalar(value)


def tensor_meta(tensor: Any) -> tuple:
    """(dtype, shape, requires_grad) of a measured tensor, for incidents' dump.json (a backend may
    give its own `tensor_meta`)."""
    return tensor.dtype, tensor.shape, getattr(tensor, "requires_grad", False)
