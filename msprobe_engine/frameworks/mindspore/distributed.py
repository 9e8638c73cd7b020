"""Merge the monitor's packed rows over MindSpore's data-parallel group (two integer AllReduces per step).

Under data parallelism (``msrun``, ``mindspore.communication.init()``) every rank measures the
same keys in the same order: its own micro-batch's activations, activation gradients and loss,
and the model state (gradients after the gradient reducer, parameters, optimizer state), which
is the same on every rank. Rows of the rank-local kinds are merged exactly (min of mins, max
of maxes, sums and counts add: the statistics of the whole global batch), model-state rows are
taken from rank 0 (adding identical copies would inflate the sums), in one int64 MAX and one
int64 SUM all-reduce whose size does not depend on the world size (`collect.integer_merge`:
exact keys for min/max, exact fixed-point sums); ranks that measured different things fail
loudly (the layout checksum rides in the MAX). With ``per_rank`` each rank keeps its own
rank-local rows and writes its own run directory; its rules then see their own rows, so a
skip/stop decision is agreed on by one ``AllReduce`` (`agree`).

MindSpore 2.10 on CPU: ``msrun`` and ``init()`` work; ``mindspore.mint.distributed.all_reduce``
reduces int32, int64 and float32 with SUM, MAX and MIN (float64 fails: "AllReduce failed"), the
``ops.AllReduce`` primitive float32/float16 with SUM only; hence the integer merge (no float64
SUM) rather than the float64 SUM and int64 MAX of the torch reducers. The per-rank spread
(`stats.ranks`) is not reported here.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np
from mindspore import Tensor, ops

from msprobe_engine.collect.integer_merge import merge_rows
from msprobe_engine.frameworks.mindspore.backend import to_host
from msprobe_engine.incident.actions import StepDecision
from msprobe_engine.reducer import Reducer
from msprobe_engine.stats import P_MAX, P_MIN, P_NAN
from msprobe_engine.stats.table import MetricKey

#: kinds whose tensors differ from rank to rank (each rank's own data)
RANK_LOCAL_KINDS = frozenset({"actv", "actv_grad", "train"})


def data_parallel_world() -> tuple[int, int]:
    """(rank, world size) of MindSpore's communication, (0, 1) when it is not initialised."""
    from mindspore.communication import GlobalComm

    if not GlobalComm.INITED:
        return 0, 1
    from mindspore.communication import get_group_size, get_rank
    return get_rank(), get_group_size()


def layout_checksum(keys: Sequence[MetricKey]) -> int:
    """The same number in every process for the same key list (unlike `hash`)."""
    return zlib.crc32("\n".join("\t".join(k) for k in keys).encode())


class DataParallelMerge(Reducer):
    """`monitor.reducer` for MindSpore data parallelism; see the module docstring."""

    def __init__(self, world: int, per_rank: bool = False) -> None:
        self.world = world
        self.rank = data_parallel_world()[0]
        self.per_rank = per_rank
        self._sum = ops.AllReduce()  # on CPU, AllReduce has only SUM
        self._masks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def merge(self, keys: Sequence[MetricKey], rows: Tensor | np.ndarray) -> Tensor:
        if self.world == 1:
            return rows
        checksum = layout_checksum(keys)
        new = checksum not in self._masks
        if new:  # (sent, given by this rank): rank-local rows merged, the rest rank 0's
            local = np.array([k.kind in RANK_LOCAL_KINDS for k in keys])
            self._masks[checksum] = (~(local & self.per_rank), local | (self.rank == 0))
        sent, gives = self._masks[checksum]
        merged = merge_rows(to_host(rows), sent, gives, checksum, self.world, _all_reduce, new_layout=new)
        nan = sent & (merged[:, P_NAN] > 0)  # MindSpore's min/max skip nan; a merged row that holds one shows it
        merged[nan, P_MIN] = merged[nan, P_MAX] = float("nan")
        return Tensor(merged)

    def agree(self, decision: StepDecision) -> StepDecision:
        """`Monitor.before_optimizer_step`, on every rank, when a rule can skip or stop: with
        `per_rank` each rank's rules judge its own activations and loss, and replicas that step
        differently diverge; one AllReduce of (skip, stop) makes any rank's apply to all."""
        if not self.per_rank or self.world == 1:
            return decision
        votes = self._sum(Tensor(np.array([decision.skip, decision.stop], np.float32))).asnumpy()
        return decision.joined(bool(votes[0] > 0), bool(votes[1] > 0))


def _all_reduce(values: np.ndarray, op: str) -> np.ndarray:
    """`values` (int64) reduced over the world with `op` ("sum", "max"): `mint.distributed`, the
    CPU collective that takes int64."""
    from mindspore import mint

    tensor = Tensor(values)
    mint.distributed.all_reduce(tensor, op=op)
    return tensor.asnumpy()
