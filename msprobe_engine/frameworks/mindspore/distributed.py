"""Merge the monitor's packed rows over MindSpore's data-parallel group (one AllGather per step).

Under data parallelism (``msrun``, ``mindspore.communication.init()``) every rank measures the
same keys in the same order: its own micro-batch's activations, activation gradients and loss,
and the model state (gradients after the gradient reducer, parameters, optimizer state), which
is the same on every rank. A first, tiny ``AllGather`` of (checksum of the keys, their count)
makes ranks that measured different things fail loudly (MindSpore's CPU ``AllGather`` of
unequal shapes returns garbage, it does not fail); then one ``AllGather`` of the ``[k, 8]``
rows gives every rank all of them; rows of the rank-local kinds are merged exactly (min of
mins, max of maxes, sums and counts add: the statistics of the whole global batch), model-state
rows are taken from rank 0 (adding identical copies would inflate the sums). With ``per_rank``
each rank keeps its own rank-local rows and writes its own run directory; its rules then see
their own rows, so a skip/stop decision is agreed on by one ``AllReduce`` (`agree`).

Both gathers run once per monitored step, at its one host transfer.

MindSpore 2.10 on CPU: ``msrun`` and ``init()`` work, and so do the ``AllReduce``/``AllGather``
primitives (PyNative and GRAPH_MODE; ``AllReduce`` with SUM only); ``mindspore.communication.comm_func.all_reduce`` does not
(no CPU kernel for ``InnerCommAllReduce``), so the primitive is used. That ``AllReduce`` also
refuses float64 and int64, so the world-independent merge of the torch reducers (a float64 SUM
and an int64 MAX all-reduce, `frameworks.torch.distributed`) cannot be built on it: exact sums
and a max need both; here the rows are still gathered (world x k x 64 B per rank), and the
per-rank spread (`stats.ranks`) is not reported.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np
from mindspore import Tensor, ops

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
        self.per_rank = per_rank
        self._gather = ops.AllGather()
        self._sum = ops.AllReduce()  # on CPU, AllReduce has only SUM
        self._masks: dict[int, tuple[Tensor, Tensor]] = {}

    def merge(self, keys: Sequence[MetricKey], rows: Tensor) -> Tensor:
        if self.world == 1:
            return rows
        checksum = layout_checksum(keys)
        headers = self._gather(Tensor(np.array([[checksum, len(keys)]], np.float64))).asnumpy()
        if not (headers == headers[0]).all():
            raise RuntimeError("msprobe: the ranks of the data-parallel group measured different tensors this "
                               f"step (rank: [layout checksum, count] = {headers.tolist()}: different Cell calls, "
                               "or not every rank reported a loss); their statistics cannot be merged. Every rank "
                               "must run the same Cells and report alike.")
        if checksum not in self._masks:
            local = np.array([k.kind in RANK_LOCAL_KINDS for k in keys])
            self._masks[checksum] = (Tensor(local[:, None]), Tensor((local & self.per_rank)[:, None]))
        merge_mask, keep_own = self._masks[checksum]
        stacked = self._gather(rows).reshape(self.world, len(keys), rows.shape[1])
        merged = stacked.sum(axis=0)
        nan = merged[:, P_NAN] > 0  # MindSpore's min/max skip nan; a merged row that holds one shows it
        merged[:, P_MIN] = ops.where(nan, float("nan"), stacked[:, :, P_MIN].min(axis=0))
        merged[:, P_MAX] = ops.where(nan, float("nan"), stacked[:, :, P_MAX].max(axis=0))
        merged = ops.where(merge_mask, merged, stacked[0])
        return ops.where(keep_own, rows, merged)

    def agree(self, decision: StepDecision) -> StepDecision:
        """`Monitor.before_optimizer_step`, on every rank, when a rule can skip or stop: with
        `per_rank` each rank's rules judge its own activations and loss, and replicas that step
        differently diverge; one AllReduce of (skip, stop) makes any rank's apply to all."""
        if not self.per_rank or self.world == 1:
            return decision
        votes = self._sum(Tensor(np.array([decision.skip, decision.stop], np.float32))).asnumpy()
        return decision.joined(bool(votes[0] > 0), bool(votes[1] > 0))
