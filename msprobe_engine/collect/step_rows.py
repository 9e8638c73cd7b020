"""The rows measured on the device, waiting for the one device-to-host copy of their step.

`Monitor.add_tensors` hands each call's rows here (still on the device, often not even packed);
`transfer` packs every waiting row, merges them over the process groups (the monitor's
reducer), copies them to the host once and returns them as a `StatTable` per step. In
one-step-late mode the copy is only started (`backend.start_copy`) and read by the next
transfer. Each transfer of the current step adds the self-metering rows (`METER_KEYS`).
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from msprobe_engine.stats import empty_rows
from msprobe_engine.stats import ranks as rank_stats
from msprobe_engine.stats.columns import P_SUM, builtin_row
from msprobe_engine.stats.table import MetricKey, StatTable

if TYPE_CHECKING:
    from msprobe_engine.reducer import Reducer

#: the rows of the per-rank spread a reducer adds (`stats.ranks`: stripped off into `StatTable.ranks`)
RANK_KEYS = [MetricKey(rank_stats.KIND, name) for name in rank_stats.NAMES]
#: the monitor's own cost, one row each in the step's table (docs/overhead.md)
METER_KEYS = [MetricKey("monitor", "overhead_ms"), MetricKey("monitor", "host_syncs"),
              MetricKey("monitor", "tensors")]

Waiting = tuple[int, list[MetricKey], Any]  # (step, keys, rows on the device)
#: how many transfers' own (unmerged) rows each rank keeps on the device, for an incident naming it
OWN_TRANSFERS = 4


class StepRows:
    """Waiting rows, the copy left running, and the counts of transfers and blocking reads."""

    def __init__(self) -> None:
        self.pending: list[Waiting] = []
        #: key -> (rows, index) of its last pending row given with `same` (`Monitor.add_tensors`)
        self.last: dict[MetricKey, tuple[Any, int]] = {}
        self.transfers = 0
        #: blocking device-to-host reads so far (at most one per monitored step)
        self.host_syncs = 0
        self._in_flight: tuple | None = None  # the copy left running: (keys, steps, meter rows, copy)
        self._meter = [0.0, 0]  # seconds in add_tensors and tensors measured since the last transfer
        #: this rank's rows before the merge, of the last merged transfers: (keys, steps, rows on the device)
        self.own: deque[tuple[list[MetricKey], np.ndarray, Any]] = deque(maxlen=OWN_TRANSFERS)
        #: rows whose tensors are measured together later (the backend's `LaterRows`; None: none
        #: yet, False: the backend has none); `settle` measures them, before any read of the rows
        self.later: Any = None

    def settle(self) -> None:
        """Measure the tensors whose rows wait in `later` (a micro-step's end, a read of the rows);
        the time counts in the monitor's overhead."""
        if self.later:
            started = time.perf_counter()
            self.later.settle()
            self._meter[0] += time.perf_counter() - started

    @property
    def waiting(self) -> bool:
        """Rows not yet transferred, or a copy not yet read."""
        return bool(self.pending) or self._in_flight is not None

    @property
    def reading_late(self) -> bool:
        """The last transfer only started its copy (read by the next transfer)."""
        return self._in_flight is not None

    def add(self, step: int, keys: Sequence[MetricKey], rows: Any, *, remember: bool, seconds: float,
            measured: int) -> None:
        """Rows of `keys` measured in `step`; `remember`: later calls may repeat them (`last`)."""
        self.pending.append((step, list(keys), rows))
        if remember:
            self.last.update(zip(keys, zip(itertools.repeat(rows), itertools.count())))
        self._meter[0] += seconds
        self._meter[1] += measured

    def discard(self, step: int, kind: str, backend: Any) -> None:
        """Drop the waiting rows of `kind` measured in `step`."""
        self.settle()
        kept = []
        for at, keys, rows in self.pending:
            keep = [i for i, key in enumerate(keys) if at != step or key.kind != kind]
            if len(keep) == len(keys):
                kept.append((at, keys, rows))
            elif keep:
                kept.append((at, [keys[i] for i in keep], backend.concat([rows])[keep]))
        self.pending = kept

    def transfer(self, step: int, backend: Any, reducer: "Reducer | None", *, reduce: bool, merge: bool,
                 late: Callable[[Any], bool] | None) -> dict[int, StatTable]:
        """The one device-to-host copy: every waiting row, grouped by step (a table for `step`
        always). `reduce`: a real step's transfer (it reads a copy left running and meters the
        step; a replay's does not); `merge`: through `reducer`; `late(rows)`: whether this
        copy may be read one step late (then it is only started, and `step` has no rows yet)."""
        started = time.perf_counter()
        self.settle()
        pending, self.pending = self.pending, []
        self.last.clear()
        tables: dict[int, StatTable] = {}
        waits = 0
        if reduce and self._in_flight is not None:
            keys, steps, meter, copy = self._in_flight
            self._in_flight = None
            host, waited = copy.result()
            waits += waited
            self.host_syncs += waited
            tables = _tables_by_step(keys, steps, np.concatenate([host, meter]))
        if not pending:
            tables.setdefault(step, StatTable([], empty_rows()))
            return tables
        keys = [k for _, ks, _ in pending for k in ks]
        rows = backend.concat([r for _, _, r in pending])
        steps = np.repeat([s for s, ks, _ in pending], [len(ks) for _, ks, _ in pending])
        spread = None
        if merge and reducer is not None:
            self.own.append((list(keys), steps, rows))
            keys, steps, rows = reducer.complete(keys, steps, rows)
            rows = reducer.merge(keys, rows)
            spread = reducer.spread()
        if spread is not None:  # travels with the rows, to this transfer's last step
            rows = backend.concat([rows, spread])
            keys += RANK_KEYS
            steps = np.concatenate([steps, [steps[-1]] * len(RANK_KEYS)])
        read_late = late is not None and late(rows)
        if read_late:
            copy = backend.start_copy(rows)
        else:
            host = backend.to_host(rows)
            self.host_syncs += 1
        self.transfers += 1
        if reduce and steps[-1] == step:  # the metering rows (none in a replay's table, nor at a
            # drain after the last step's end, which would make a record of them alone)
            overhead_ms = (self._meter[0] + time.perf_counter() - started) * 1e3
            meter = np.array([_scalar_row(overhead_ms), _scalar_row(waits + (not read_late)),
                              _scalar_row(self._meter[1])])
            self._meter = [0.0, 0]
            keys += METER_KEYS
            steps = np.concatenate([steps, [step] * len(METER_KEYS)])
        else:
            meter = empty_rows()
        if read_late:
            self._in_flight = (keys, steps, meter, copy)
            return tables
        for at, table in _tables_by_step(keys, steps, np.concatenate([host, meter])).items():
            _join(tables, at, table)
        tables.setdefault(step, StatTable([], empty_rows()))
        return tables


    def own_tables(self, backend: Any) -> dict[int, StatTable]:
        """This rank's own rows (before the merge) of the last merged transfers, by step: one host
        copy, only when asked (an incident names this rank)."""
        tables: dict[int, StatTable] = {}
        for keys, steps, rows in self.own:
            for at, table in _tables_by_step(keys, steps, backend.to_host(rows)).items():
                _join(tables, at, table)
        return tables


def _join(tables: dict[int, StatTable], at: int, table: StatTable) -> None:
    """`table` into `tables[at]`, after the rows already there (the spread of either kept)."""
    if at in tables:
        ranks = table.ranks or tables[at].ranks
        table = StatTable.from_rows(tables[at].keys + table.keys, np.concatenate([tables[at].partials, table.partials]))
        table.ranks = ranks
    tables[at] = table


def _scalar_row(value: float) -> list[float]:
    """The partial-statistics row of one number."""
    return builtin_row({"min": value, "max": value, "sum": value, "sumsq": value * value, "nan_count": 0.0,
                        "inf_count": 0.0, "zero_count": float(value == 0), "numel": 1.0})


def _tables_by_step(keys: list[MetricKey], steps: np.ndarray, host: np.ndarray) -> dict[int, StatTable]:
    """Transferred rows as one table per step (one slice per step once grouped by step)."""
    if len(steps) > 1 and (np.diff(steps) < 0).any():
        order = np.argsort(steps, kind="stable")
        keys, steps, host = [keys[i] for i in order], steps[order], host[order]
    bounds = np.flatnonzero(np.diff(steps)) + 1
    starts, ends = [0, *bounds.tolist()], [*bounds.tolist(), len(steps)]
    return {int(steps[a]): _with_ranks(keys[a:b], host[a:b]) for a, b in zip(starts, ends)}


def _with_ranks(keys: list[MetricKey], host: np.ndarray) -> StatTable:
    """A step's table, the rows of the per-rank spread (`RANK_KEYS`) taken off into `ranks`."""
    spread = [i for i, key in enumerate(keys) if key.kind == rank_stats.KIND]
    if not spread:
        return StatTable.from_rows(keys, host)
    kept = [i for i, key in enumerate(keys) if key.kind != rank_stats.KIND]
    table = StatTable.from_rows([keys[i] for i in kept], host[kept])
    table.ranks = rank_stats.RankSpread.of(host[spread[-len(RANK_KEYS):], P_SUM])
    return table
