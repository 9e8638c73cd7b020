"""`skip` inside a compiled MindSpore graph: the optimizer step applied only when the gradients are finite.

In GRAPH_MODE (or a `mindspore.jit` train step) the optimizer runs inside the graph, before the
host has seen the step's statistics, so no host decision can keep it from running. `FiniteGate`
wraps the optimizer Cell the way MindSpore's loss-scale cells do: the step is applied only when
every gradient is finite (`mindspore.amp.all_finite`), a branch taken inside the graph. A
skipped step leaves the weights, the moments and the optimizer's step counters as they were;
`skipped` counts the skipped steps (a Parameter, read when wanted)::

    train_net = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), FiniteGate(optimizer), return_grad=True)

The gate is the in-graph counterpart of a `non_finite` rule with `action: skip` on the
gradients: it does not read the host's rules, and a non-finite activation whose gradients stay
finite does not stop the step (the weights are then unharmed).
"""
from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, amp, nn, ops


class FiniteGate(nn.Cell):
    """`optimizer`, applied to `grads` only when they are all finite; returns whether it was."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer
        #: what `TrainOneStepCell` differentiates for (the optimizer's parameters)
        self.parameters = optimizer.parameters
        self.skipped = Parameter(Tensor(np.zeros((), np.int32)), name="msprobe_skipped_steps", requires_grad=False)

    def construct(self, grads):
        finite = amp.all_finite(grads)
        if finite:
            finite = ops.depend(finite, self.optimizer(grads))
        else:
            finite = ops.depend(finite, ops.assign_add(self.skipped, Tensor(1, ms.int32)))
        return finite
