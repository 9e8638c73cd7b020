"""grad_probe for MindSpore (PyNative): per-parameter gradient statistics and directions at every optimizer step.

``debugger = MindSporePrecisionDebugger({"task": "grad_probe", ...}); debugger.monitor(optimizer)``
(the predecessor's MindSpore call takes the optimizer): a forward pre-hook on the optimizer
Cell receives the gradients it is about to apply (``optimizer(grads)``, also inside
``Model.train``'s train network in PyNative), in the order of ``optimizer.parameters``, and
probes those of the watched parameters (``param_list``, by ``Parameter.name``; [] all).
max/min/norm come from the MindSpore backend (one compiled graph, one host transfer per step);
L0's MD5, L1/L2's directions and L2's interval shares need the values: all watched gradients
are concatenated and copied to the host once per step (float32). Files and columns are
PyTorch's (`msprobe_engine.dump.grad_probe_files`), written by the session's writer thread.
Optimizer steps are counted from 0; ``step`` and ``rank`` select as for a dump.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump.grad_probe import GradProbeRecorder
from msprobe_engine.dump.grad_probe_files import GradRows, check_param_list, interval_counts
from msprobe_engine.dump.recorder import RecorderContext
from msprobe_engine.frameworks.mindspore import backend as mindspore_backend
from msprobe_engine.frameworks.mindspore.cell_hooks import jit_safe
from msprobe_engine.stats import P_MAX, P_MIN, P_SUMSQ


class MindSporeGradProbe(GradProbeRecorder):
    """The MindSpore grad_probe recorder: a forward pre-hook on the optimizer Cell."""

    def __init__(self, ctx: RecorderContext) -> None:
        super().__init__(ctx)
        self._handles: list[Any] = []

    def watch(self, optimizer: Any) -> None:
        """Probe the gradients `optimizer` applies (those of ``param_list`` when given)."""
        if not isinstance(optimizer, nn.Optimizer):
            raise ConfigError(f"grad_probe on MindSpore watches the optimizer: debugger.monitor(optimizer) with a "
                              f"mindspore.nn.Optimizer, got {type(optimizer).__name__}")
        params = list(optimizer.parameters)
        names = [p.name for p in params]
        wanted = self.options.param_list
        check_param_list(wanted, names, "the optimizer has no")
        watched = [(i, name) for i, name in enumerate(names) if not wanted or name in wanted]
        self._handles.append(optimizer.register_forward_pre_hook(jit_safe(partial(self._before_step, watched))))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---- the optimizer hook ----------------------------------------------------------------
    def _before_step(self, watched: list[tuple[int, str]], optimizer: nn.Cell, args: tuple) -> None:
        step = self._next_step()
        if step is not None:
            self._probe(step, partial(self._gradients, watched, args))

    def _gradients(self, watched: list[tuple[int, str]], args: tuple) -> GradRows | None:
        grads = list(args[0]) if args else []
        named = [(name, grads[i]) for i, name in watched if i < len(grads) and grads[i] is not None]
        return self._measure(named) if named else None

    def _measure(self, named: list[tuple[str, Any]]) -> GradRows:
        tensors = [g for _, g in named]
        stats = mindspore_backend.to_host(mindspore_backend.partial_stats(tensors))
        flat = ops.cat([t.astype(ms.float32).reshape(-1) for t in tensors]).asnumpy()  # one host copy
        self.transfers += 1
        shapes = [list(t.shape) for t in tensors]
        values, start = [], 0
        for shape in shapes:
            size = int(np.prod(shape))
            values.append(flat[start:start + size].reshape(shape))
            start += size
        rows = GradRows([n for n, _ in named], shapes,
                        np.stack([stats[:, P_MAX], stats[:, P_MIN], np.sqrt(stats[:, P_SUMSQ])], axis=1))
        level = self.options.grad_level
        if level == "L0":
            rows.values = values
        else:
            rows.directions = [v > 0 for v in values]
        if level == "L2":
            rows.counts = np.stack([interval_counts(v, self.options.bounds) for v in values])
        return rows
