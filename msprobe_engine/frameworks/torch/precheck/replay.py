"""Replay one API call twice: on the original dtype (on `device`) and on CPU in float64 (the
benchmark), forward and, when the dump holds the call's backward entry, backward.

The result holds, per output (and per input gradient), the benchmark and the device values as
numpy arrays; the analysis side (`msprobe_engine.analysis.precheck.standards`) judges them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from msprobe_engine.analysis.precheck.cases import ApiCase
from msprobe_engine.dump.schema import is_tensor_record
from msprobe_engine.frameworks.torch.precheck.inputs import Arguments, case_generator

#: dtypes the benchmark raises to float64
_RAISED = (torch.float16, torch.bfloat16, torch.float32)

#: APIs whose index argument was a tuple when it is recorded as a list
INDEXING = ("__getitem__", "__setitem__")

Pair = tuple[np.ndarray, np.ndarray, str]  # (benchmark, device, device dtype)


@dataclass
class Replayed:
    """Benchmark/device pairs of the outputs and of the input gradients; why the backward was not
    replayed (`backward_skip` None and `backward` empty: the dump has no backward entry)."""
    forward: list[Pair] = field(default_factory=list)
    backward: list[Pair] = field(default_factory=list)
    backward_skip: str | None = None


def resolve(api: str) -> Callable:
    """The function of ``Functional.gelu``, ``Torch.linalg.norm``, ``Tensor.add`` (a LookupError if none)."""
    prefix, _, name = api.partition(".")
    roots = {"Functional": torch.nn.functional, "Torch": torch, "Tensor": torch.Tensor}
    obj: Any = roots.get(prefix)
    for part in name.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    if not callable(obj):
        raise LookupError(f"{api}: no such function in torch {torch.__version__}")
    return obj


def _map(value: Any, fn: Callable[[torch.Tensor], Any], bench: bool = False) -> Any:
    """`value` with `fn` applied to its tensors; for the `bench` side, dtype arguments of
    lower precision become float64 and device arguments the CPU."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn, bench) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn, bench) for k, v in value.items()}
    if bench and isinstance(value, torch.dtype) and value in _RAISED:
        return torch.float64
    if bench and isinstance(value, torch.device):
        return torch.device("cpu")
    return value


def _leaves(value: Any) -> list[Any]:
    """Tensors and Python numbers of a (nested) value, in order."""
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value] if isinstance(value, (torch.Tensor, bool, int, float)) else []


def _to_bench(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.to(torch.float64) if t.dtype in _RAISED else t.clone()


def _host(value: Any) -> tuple[np.ndarray, str]:
    """A leaf as a numpy array (floating values as float64) and its dtype name."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        if t.is_floating_point():
            return t.to(torch.float64).numpy(), str(value.dtype)
        return t.resolve_conj().numpy(), str(value.dtype)
    return np.asarray(value), type(value).__name__


def _pairs(bench: list[Any], device: list[Any]) -> list[Pair]:
    """Benchmark/device arrays side by side; a value one side lacks (no gradient) is an empty array."""
    pairs = []
    for b, d in zip(bench, device):
        if b is None and d is None:
            continue
        b_arr = _host(b)[0] if b is not None else np.zeros(0)
        d_arr, dtype = _host(d) if d is not None else (np.zeros(0), "none")
        pairs.append((b_arr, d_arr, dtype))
    return pairs


class _Run:
    """One side of the replay: arguments on a device/dtype, the forward call, its gradients."""

    def __init__(self, func: Callable, args: list, kwargs: dict, want_grad: list[bool], inplace: bool = False) -> None:
        self.leaves = [t for t, wanted in zip(tensors_of((args, kwargs)), want_grad)
                       if wanted and t.is_floating_point() and t.is_leaf]
        for t in self.leaves:
            t.requires_grad_(True)
        self.output = func(*args, **kwargs)
        if self.output is None and inplace and args:  # __setitem__: what it wrote into is the result
            self.output = args[0]

    def grads(self, grad_outputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        outs = [o for o in tensors_of(self.output) if o.requires_grad]
        if len(outs) != len(grad_outputs):
            raise ValueError(f"{len(grad_outputs)} output gradient(s) recorded for {len(outs)} "
                             f"differentiable output(s)")
        grads = torch.autograd.grad(outs, self.leaves, [g.to(o.device, o.dtype) for o, g in zip(outs, grad_outputs)],
                                    allow_unused=True)
        return list(grads)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) value, in order."""
    return [leaf for leaf in _leaves(value) if isinstance(leaf, torch.Tensor)]


def replay(case: ApiCase, device: str = "cpu", recorded_output: bool = False) -> Replayed:
    """Replay `case` on `device` (original dtypes) and on CPU float64. With `recorded_output` the
    forward compares the output the case carries (online: the training's own); the device side
    then runs only for the backward (the training's per-call input gradients are not observable)."""
    func = resolve(case.api)
    values = Arguments(f"{case.name}.forward", case.source, case_generator(case.name))
    inputs = (case.forward.get("input_args", []), case.forward.get("input_kwargs", {}))
    args, kwargs = values.value(inputs[0], "input_args"), values.value(inputs[1], "input_kwargs")
    if case.target in INDEXING and len(args) > 1 and isinstance(args[1], list):
        args[1] = tuple(args[1])  # the dump writes tuples as lists; an index tuple is not a list index
    backward = None if case.inplace else case.backward
    want_grad = _wants_grad(inputs) if backward is not None else []
    result = Replayed()
    with torch.no_grad() if backward is None else torch.enable_grad():
        bench = _Run(func, *_map((args, kwargs), _to_bench, bench=True), want_grad, case.inplace)
        dev = None
        if not recorded_output or backward is not None:
            dev_args, dev_kwargs = _map((args, kwargs), lambda t: t.detach().to(device, copy=True))
            dev = _Run(func, dev_args, dev_kwargs, want_grad, case.inplace)
    device_out = values.value(case.forward.get("output"), "output") if recorded_output else dev.output
    result.forward = _pairs(_leaves(bench.output), _leaves(device_out))
    if case.backward is not None and case.inplace:
        result.backward_skip = "in-place op: its backward is not replayed"
    if backward is None or dev is None:
        return result
    grad_values = Arguments(f"{case.name}.backward", case.source, case_generator(case.name + ".backward"))
    grad_outputs = tensors_of(grad_values.value(backward.get("input", []), "input"))
    try:
        result.backward = _pairs(bench.grads(grad_outputs), dev.grads(grad_outputs))
    except (RuntimeError, ValueError) as e:
        result.backward_skip = f"backward not replayed: {str(e).splitlines()[0]}"
    return result


def _wants_grad(item: Any) -> list[bool]:
    """Per tensor of recorded arguments (records or inline tensors), in the order `tensors_of`
    finds them: whether it required grad in the training."""
    if isinstance(item, torch.Tensor):
        return [item.requires_grad]
    if isinstance(item, (list, tuple)):
        return [w for sub in item for w in _wants_grad(sub)]
    if is_tensor_record(item):
        return [bool(item.get("requires_grad"))]
    if isinstance(item, dict) and "type" not in item:
        return [w for sub in item.values() for w in _wants_grad(sub)]
    return []
