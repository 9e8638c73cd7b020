"""Forward hooks (and output-gradient tensor hooks) on selected torch modules.

Each hook returns at once on unmonitored steps. On monitored steps it hands
the module's tensors to the monitor, which reduces them on their device in
one batched call; nothing is copied to the host here. A module called k
times in one micro-step is named `path`, `path:1`, ... `path:k-1`; calls in
later micro-steps of the same optimizer step merge into the same names.
Forward recomputation during backward (activation checkpointing) is not
counted again; its calls are numbered like the original ones (in recompute
order, which matches the original order unless one module is shared by
several checkpointed segments).
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from msprobe_engine.collect.flatten import iter_tensors
from msprobe_engine.collect.selection import ModuleFilter
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def in_backward() -> bool:
    """True while autograd runs a backward pass (checkpoint recomputation happens there)."""
    return torch._C._current_graph_task_id() != -1


class ModuleHooks:
    """Installs and removes the module hooks of one model."""

    def __init__(self, monitor: "Monitor", model: torch.nn.Module, prefix: str = "") -> None:
        self.monitor = monitor
        watch = monitor.config.watch
        self.inputs = watch.module_inputs
        self.outputs = watch.module_outputs
        self.grads = watch.activation_grads
        self.calls: dict[str, int] = defaultdict(int)
        self.recomputed: dict[str, int] = defaultdict(int)
        self.handles: list = [model.register_forward_pre_hook(self._root_pre_hook)]
        self.paths: list[str] = []
        if not (self.inputs or self.outputs or self.grads):
            return
        wanted = ModuleFilter(monitor.config.modules)
        for name, module in model.named_modules():
            if name == "":
                continue  # the root's output is the loss or the logits: reported as train/loss
            path = f"{prefix}{name}"
            if wanted(path, type(module).__name__):
                self.paths.append(path)
                self.handles.append(module.register_forward_hook(self._make_hook(path), with_kwargs=True))
        monitor.warn_unmatched("modules.names", wanted.unmatched_names(
            {f"{prefix}{n}" for n, _ in model.named_modules()}))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _root_pre_hook(self, module, args) -> None:
        if in_backward():
            return
        self.calls.clear()
        self.recomputed.clear()
        self.monitor.micro_step_begin()

    def _make_hook(self, path: str):
        monitor = self.monitor

        def hook(module, args, kwargs, output):
            if not monitor.active:
                return
            with monitor.guard(f"forward hook of {path}"):
                recompute = in_backward()
                counter = self.recomputed if recompute else self.calls
                n = counter[path]
                counter[path] = n + 1
                name = path if n == 0 else f"{path}:{n}"
                self._collect(name, args, kwargs, output, recompute)

        return hook

    def _collect(self, name: str, args, kwargs, output, recompute: bool) -> None:
        found = list(iter_tensors(output, "output", _is_tensor))
        if not recompute:
            tensors = [t for _, t in found] if self.outputs else []
            keys = [MetricKey("actv", name, role) for role, _ in found] if self.outputs else []
            if self.inputs:
                inputs = [*enumerate(args), *kwargs.items()]
                for role, t in iter_tensors(dict(inputs), "input", _is_tensor):
                    keys.append(MetricKey("actv", name, role))
                    tensors.append(t)
            self.monitor.add_tensors(keys, tensors)
        if self.grads:
            # Under checkpointing, hooks on the pass that autograd differentiates are the ones that fire.
            for role, t in found:
                if t.requires_grad:
                    t.register_hook(self._make_grad_hook(MetricKey("actv_grad", name, role)))

    def _make_grad_hook(self, key: MetricKey):
        monitor = self.monitor

        def grad_hook(grad):
            if monitor.active:
                with monitor.guard(f"gradient hook of {key.path}"):
                    monitor.add_tensors([key], [grad])

        return grad_hook

