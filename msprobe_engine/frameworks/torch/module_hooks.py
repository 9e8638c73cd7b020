"""Forward hooks (and output-gradient tensor hooks) on selected torch modules.

Each hook returns at once on unmonitored steps. On monitored steps it hands
the module's tensors to the monitor, which reduces them on their device in
one batched call (on CPU, those of the whole forward together at its end:
`later_rows`); nothing is copied to the host here. A module called k
times in one micro-step is named `path`, `path:1`, ... `path:k-1`; calls in
later micro-steps of the same optimizer step merge into the same names.
Forward recomputation during backward (activation checkpointing) is not
counted again; its calls are numbered like the original ones (in recompute
order, which matches the original order unless one module is shared by
several checkpointed segments).

A tensor measured earlier in the micro-step (an input that is an earlier call's
output, a parent returning its child's output) is not reduced again: its row repeats
the earlier one (`torch_flow.TensorFlow`). When incidents are on, the hooks also note
in the monitor's `CallGraph` which rows measured each call's inputs: inputs no earlier
row measured are measured once, as are (with activation gradients) their gradients.

Under `torch.compile` (the hook traced by Dynamo) a hook takes the traced path of
`compiled_hooks` instead: tensor ops writing into the monitor's device buffer, nothing else.
A `torch.compile(model)` wrapper given here is unwrapped (its root pre-hook stays on the
wrapper, outside the graph), and the `_orig_mod` parts of compiled submodules' paths dropped;
the hooks of a compiled module's root run eagerly (`compiled_hooks.never_a_frame`), and a root
pre-hook traced inside a larger compiled module counts the micro-step at run time
(`compiled_hooks.RunTimeCall`).
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Callable

import torch

from msprobe_engine.collect.flatten import iter_tensors
from msprobe_engine.collect.selection import ModuleFilter
from msprobe_engine.frameworks.torch.compiled_hooks import CompiledCapture, RunTimeCall, clean_path, is_compiled_wrapper, \
    never_a_frame, unwrap
from msprobe_engine.frameworks.torch.flow import TensorFlow
from msprobe_engine.handles import Handles
from msprobe_engine.incident.graph import INPUT_GRAD_KIND
from msprobe_engine.stats import optional_columns
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def in_backward() -> bool:
    """True while autograd runs a backward pass (checkpoint recomputation happens there)."""
    return torch._C._current_graph_task_id() != -1


class ModuleHooks(Handles):
    """Installs and removes the module hooks of one model."""

    def __init__(self, monitor: "Monitor", model: torch.nn.Module, prefix: str = "", *,
                 name_map: Callable[[str], str] | None = None, counts_micro_steps: bool = True,
                 exclude_types: tuple[type, ...] = ()) -> None:
        """`name_map` turns a module path into the reported name (default: `prefix` + path);
        `counts_micro_steps=False` for all but one of several models run per micro-batch;
        modules of `exclude_types` (e.g. a framework's placeholders) are never watched."""
        self.monitor = monitor
        self.counts_micro_steps = counts_micro_steps
        rename = name_map or (lambda name: f"{prefix}{name}")
        watch = monitor.config.watch
        self.inputs = watch.module_inputs
        self.outputs = watch.module_outputs
        self.grads = watch.activation_grads
        graph = monitor.graph
        self.flow = TensorFlow(graph if self.outputs else None, self.inputs, self.outputs) \
            if self.inputs or self.outputs else None
        self.calls: dict[str, int] = defaultdict(int)
        self.recomputed: dict[str, int] = defaultdict(int)
        self._grad_hooks: dict[MetricKey, Callable] = {}  # one gradient hook per key, made once
        self._micro_step = RunTimeCall(lambda tensors, values: monitor.micro_step_begin())
        self.handles: list = [model.register_forward_pre_hook(self._root_pre_hook)]
        if self.flow is not None:  # the forward's rows measured together at its end (`later_rows`)
            self.handles.append(model.register_forward_hook(self._root_hook))
        self.paths: list[str] = []
        if not (self.inputs or self.outputs or self.grads):
            return
        wanted = ModuleFilter(monitor.config.modules)
        inner = unwrap(model)
        names = [(clean_path(name), module) for name, module in inner.named_modules()
                 if not is_compiled_wrapper(module)]
        for name, module in names:
            path = rename(name)
            if graph is not None:
                graph.classes[path] = type(module).__name__
            if name == "" or isinstance(module, exclude_types):
                continue  # the root's output is the loss or the logits: reported as train/loss
            if wanted(path, type(module).__name__):
                self.paths.append(path)
                self.handles.append(module.register_forward_hook(self._make_hook(path), with_kwargs=True))
        monitor.warn_unmatched("modules.names", wanted.unmatched_names({rename(n) for n, _ in names}))
        self.compiled = CompiledCapture(monitor, len(names), _device_of(inner),
                                        "zero_count" in optional_columns(monitor.config.stats),
                                        ran_eagerly=self._ran_eagerly if self.paths else None)

    def _ran_eagerly(self) -> bool:
        """Whether a hook ran on the eager path in the current micro-step."""
        return bool(self.calls or self.recomputed)

    @never_a_frame
    def _root_pre_hook(self, module, args) -> None:
        if torch.compiler.is_compiling():
            if self.counts_micro_steps:  # the model compiled after attach: this hook is traced
                self._micro_step()
            return
        if in_backward():
            return
        self.calls.clear()
        self.recomputed.clear()
        if self.flow is not None:
            self.flow.new_micro_step()
        if self.counts_micro_steps:
            self.monitor.micro_step_begin()

    @never_a_frame
    def _root_hook(self, module, args, output) -> None:
        if not torch.compiler.is_compiling() and self.monitor.active:
            self.monitor.rows.settle()

    def _make_hook(self, path: str):
        monitor = self.monitor
        where = f"forward hook of {path}"
        names = [path]  # the name of each call in a micro-step: path, path:1, ... (made once)

        @never_a_frame  # a compiled submodule's own hooks: eager, not a graph of their own
        def hook(module, args, kwargs, output):
            if torch.compiler.is_compiling():
                return self._traced(path, args, kwargs, output) if monitor.active else None
            if not monitor.active or where in monitor.disabled:
                return
            try:
                recompute = in_backward()
                counter = self.recomputed if recompute else self.calls
                n = counter[path]
                counter[path] = n + 1
                if n == len(names):
                    names.append(f"{path}:{n}")
                self._collect(names[n], args, kwargs, output, recompute)
            except Exception as exc:
                monitor.hook_failed(where, exc)

        return hook

    def _traced(self, path: str, args, kwargs, output):
        """The hook's body inside a compiled graph: rows into the device buffer; with activation
        gradients, the output returned through the gradient taps."""
        compiled = self.compiled
        if self.inputs:
            for role, t in iter_tensors(dict([*enumerate(args), *kwargs.items()]), "input", _is_tensor):
                compiled.record("actv", path, role, t)
        if self.outputs:
            for role, t in iter_tensors(output, "output", _is_tensor):
                compiled.record("actv", path, role, t)
        if not self.grads:
            return None
        return _map_tensors(output, "output", lambda role, t: compiled.tap("actv_grad", path, role, t)
                            if t.requires_grad else t)

    def _collect(self, name: str, args, kwargs, output, recompute: bool) -> None:
        found = list(iter_tensors(output, "output", _is_tensor))
        if not recompute and self.flow is not None:
            inputs = []
            if self.flow.reads_inputs:
                inputs = list(iter_tensors(dict([*enumerate(args), *kwargs.items()]), "input", _is_tensor))
            ins, outs = self.flow.note_call(name, inputs, found)
            rows = outs + ins if self.inputs else ins + outs  # hidden inputs first: they were there before
            self.monitor.add_tensors([key for key, _, _ in rows], [t for _, t, _ in rows],
                                     same=[prior for _, _, prior in rows], later=True)
            if self.grads and self.flow.graph is not None:
                for key, t, prior in ins:
                    if prior is None:
                        self._hook_grad(t, MetricKey(INPUT_GRAD_KIND, name, key.role))
        if self.grads:
            # Under checkpointing, hooks on the pass that autograd differentiates are the ones that fire.
            for role, t in found:
                self._hook_grad(t, MetricKey("actv_grad", name, role))

    def _hook_grad(self, tensor: torch.Tensor, key: MetricKey) -> None:
        # A leaf (a parameter returned as is, like Megatron's skip_bias_add bias) would keep
        # every hook registered on it, one more each step: it is not hooked.
        if tensor.requires_grad and tensor.grad_fn is not None:
            hook = self._grad_hooks.get(key)
            if hook is None:
                hook = self._grad_hooks[key] = self._make_grad_hook(key)
            tensor.register_hook(hook)

    def _make_grad_hook(self, key: MetricKey):
        monitor = self.monitor
        where = f"gradient hook of {key.path}"

        def grad_hook(grad):
            if monitor.active and where not in monitor.disabled:
                try:
                    monitor.add_tensors([key], [grad])
                except Exception as exc:
                    monitor.hook_failed(where, exc)

        return grad_hook


def _map_tensors(value, role: str, fn: Callable[[str, torch.Tensor], torch.Tensor]):
    """`value` with each tensor t in it (named as `iter_tensors` names it) replaced by fn(role, t)."""
    if _is_tensor(value):
        return fn(role, value)
    if type(value) in (tuple, list):  # other containers (named tuples, model outputs) stay as they are
        return type(value)(_map_tensors(item, f"{role}.{i}", fn) for i, item in enumerate(value))
    if type(value) is dict:
        return {key: _map_tensors(item, f"{role}.{key}", fn) for key, item in value.items()}
    return value


def _device_of(model: torch.nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")
