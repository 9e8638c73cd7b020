"""grad_probe for PyTorch: per-parameter gradient statistics and directions at every optimizer step.

``debugger = PrecisionDebugger({"task": "grad_probe", ...}); debugger.monitor(model)``: a global
optimizer pre-step hook (``torch.optim.Optimizer``) reads the watched parameters' gradients
(``main_grad`` when present, as Megatron keeps it) just before each step. Statistics are
batched on the device (the monitor's `partial_stats`, interval counts by ``bucketize`` and
``bincount``) and copied to the host once per step; L0's MD5 and L1/L2's directions need the
gradients' values or signs, copied once per step as one concatenated tensor each. The files
(`msprobe_engine.dump.grad_probe_files`) are written by the session's writer thread.
Optimizer steps are counted from 0; ``step`` and ``rank`` select as for a dump.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from msprobe_engine.dump.grad_probe import GradProbeRecorder
from msprobe_engine.dump.grad_probe_files import GradRows, check_param_list
from msprobe_engine.dump.recorder import RecorderContext
from msprobe_engine.frameworks.torch import backend as torch_backend
from msprobe_engine.stats import P_MAX, P_MIN, P_SUMSQ


class GradProbe(GradProbeRecorder):
    """The PyTorch grad_probe recorder: a global optimizer pre-step hook."""

    def __init__(self, ctx: RecorderContext) -> None:
        super().__init__(ctx)
        self._params: dict[str, torch.nn.Parameter] = {}
        self._bounds = torch.tensor(self.options.bounds, dtype=torch.float64)
        self._handle = register_optimizer_step_pre_hook(self._before_step)

    def watch(self, model: torch.nn.Module) -> None:
        """Probe `model`'s trainable parameters (those of ``param_list`` when given)."""
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        wanted = self.options.param_list
        check_param_list(wanted, list(named), "the model has no trainable")
        self._params.update((n, p) for n, p in named.items() if not wanted or n in wanted)

    def remove(self) -> None:
        self._handle.remove()

    # ---- the optimizer hook ----------------------------------------------------------------
    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        step = self._next_step()
        if step is None:
            return
        watched = {id(p) for group in optimizer.param_groups for p in group["params"]}
        grads = [(n, g) for n, p in self._params.items()
                 if id(p) in watched and (g := _grad_of(p)) is not None]
        if grads:
            self._probe(step, partial(self._measure_no_grad, grads))

    def _measure_no_grad(self, grads: list[tuple[str, torch.Tensor]]) -> GradRows:
        with torch.no_grad():
            return self._measure(grads)

    def _measure(self, grads: list[tuple[str, torch.Tensor]]) -> GradRows:
        level = self.options.grad_level
        tensors = [g.detach() for _, g in grads]
        stats = torch_backend.partial_stats(tensors)
        parts = [torch.stack([stats[:, P_MAX], stats[:, P_MIN], stats[:, P_SUMSQ].sqrt()], dim=1)]
        if level == "L2":
            parts.append(torch.stack([_interval_counts(t, self._bounds) for t in tensors]).to(torch.float64))
        host = torch_backend.to_host(torch.cat([p.to(parts[0].device) for p in parts], dim=1))
        self.transfers += 1
        rows = GradRows([n for n, _ in grads], [list(t.shape) for t in tensors], host[:, :3],
                        counts=host[:, 3:] if level == "L2" else None)
        if level == "L0":
            rows.values = _split(torch.cat([t.float().reshape(-1) for t in tensors]), tensors)
        else:
            rows.directions = _split(torch.cat([(t > 0).reshape(-1) for t in tensors]), tensors)
        return rows


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def _interval_counts(tensor: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Counts per interval ``(-inf, b0], (b0, b1]... (bn, inf)`` and of exact zeros, compared in float64."""
    flat = tensor.reshape(-1).to(torch.float64)
    index = torch.bucketize(flat, bounds.to(flat.device))  # right=False: b[i-1] < x <= b[i]
    counts = torch.bincount(index, minlength=len(bounds) + 1)
    return torch.cat([counts, (flat == 0).sum().reshape(1)])


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[np.ndarray]:
    """One host copy of `flat`, cut back into arrays shaped like `like`."""
    host = flat.to("cpu").numpy()
    out, start = [], 0
    for t in like:
        out.append(host[start:start + t.numel()].reshape(t.shape))
        start += t.numel()
    return out
