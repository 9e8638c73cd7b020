"""Statistics measured inside a `torch.compile`d graph, with no graph break and no recompilation.

When Dynamo traces a watched module (`torch.compiler.is_compiling()` is true in its hook),
the hook does not take the eager path (Python state, clocks, the call graph); it computes
each tensor's partial row with tensor ops and merges it, in place, into the row of its name
in the monitor's preallocated device rows (`CompiledCapture.buffer`, one tensor per name: a graph
saves the rows its gradient taps write, and a shared tensor written by another graph in the
meantime, in a model with graph breaks of its own, would fail autograd's version check). A row is
an input of the graph, so the write survives functionalization as an input mutation and runs at
every call of the compiled code; inductor fuses the reductions with the producing kernels.
Activation gradients go the same way through `_GradTap`, an identity autograd function whose
backward (traced into the compiled backward graph) writes the gradient's row.

Which row a name owns is decided once, while tracing (`_slot`, a constant of the graph), so
nothing Python-side runs at run time. Outside the graph, once a step (the optimizer's pre-step
hook, `harvest`), the rows written are copied out of the buffer as one block of the step's
rows, and the buffer is reset. Names, rules, timing and the one host transfer stay outside.
The graph reads one Python value, `Monitor.active` (guarded): a monitored step and an
unmonitored one use two graphs, no more.

Python work that must happen at every call but cannot be traced (a loss kept in a list, a
micro-step counted) goes through `RunTimeCall`: a registered `torch.library` op (`msprobe::at_run_time`,
a fake implementation for tracing) that the graph calls at run time with its tensors and integer
constants, so no Python state is captured in the graph or guarded on.

A hook of the module that `torch.compile(module)` wraps is run by torch's own module code, and Dynamo
would compile it as a frame (a graph) of its own: `never_a_frame` hooks run eagerly there instead
(the eager path, no graph), and are traced only where they are inlined into a traced frame.

Under compile, a module called several times in a step has one row (its calls merged), and
inputs are rows only when `watch.module_inputs` is on (no hidden input rows for incidents).
"""
from __future__ import annotations

import itertools
import math
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from msprobe_engine.frameworks.torch import opaque_row
from msprobe_engine.stats import columns
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.monitor import Monitor

#: rows of the buffer per watched module (its outputs, inputs and their gradients); names
#: beyond the buffer's rows are not measured under compile (a warning says so)
ROWS_PER_MODULE = 8
#: the kinds of gradient rows: written during backward, reported in backward order
GRAD_KINDS = ("actv_grad",)

#: the warning of a step where no watched module's hook ran, eagerly or in a graph
STALE_GRAPH = ("no watched module's hook ran in this step. A model compiled and run before the monitor was "
               "attached keeps the graph it compiled without the hooks: attach the monitor before the first "
               "call of the compiled model (or call torch._dynamo.reset() after attaching it)")

_CAPTURES: "weakref.WeakValueDictionary[int, CompiledCapture]" = weakref.WeakValueDictionary()
_BY_MONITOR: "weakref.WeakKeyDictionary[Any, list[CompiledCapture]]" = weakref.WeakKeyDictionary()
_ids = itertools.count()


def compiled_parts(model: torch.nn.Module) -> bool:
    """Whether `model` is, or holds, a `torch.compile`d module."""
    return any(is_compiled_wrapper(m) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module a `torch.compile(model)` wrapper (an OptimizedModule) compiles; else `model`."""
    return model._orig_mod if is_compiled_wrapper(model) else model


def clean_path(name: str) -> str:
    """A module or parameter path with the compile wrappers' `_orig_mod` parts taken out, so
    that it reads as in the uncompiled model (`layers.0._orig_mod.fc1` -> `layers.0.fc1`)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def is_compiled_wrapper(module: torch.nn.Module) -> bool:
    """Whether `module` is what `torch.compile(module)` returns (an OptimizedModule)."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def harvest(monitor: "Monitor") -> None:
    """Hand the rows the compiled code wrote in this step, for every model of `monitor`, to it
    (`CompiledCapture.harvest`); nothing when no graph was traced."""
    for capture in _BY_MONITOR.get(monitor, ()):
        capture.harvest()


@torch.compiler.assume_constant_result
def _slot(capture: int, kind: str, path: str, role: str) -> int:
    """The buffer row of a name (-1: the buffer is full). Runs while tracing only: its result
    is a constant of the graph."""
    return _CAPTURES[capture].slot(MetricKey(kind, path, role))


def never_a_frame(fn: Callable) -> Callable:
    """`fn` (a hook), never compiled as a frame of its own: where Dynamo would start a frame at it,
    it runs eagerly with all it calls; inlined into a traced frame it is traced. (Dynamo's
    per-code frame strategy; on a torch without it, such a hook is compiled as its own graph.)"""
    try:
        from torch._dynamo.eval_frame import FrameAction, FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # pragma: no cover - torch versions before 2.6
        return fn
    set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return fn


_RUN_TIME: "weakref.WeakValueDictionary[int, RunTimeCall]" = weakref.WeakValueDictionary()


@torch.library.custom_op("msprobe::at_run_time", mutates_args=("token",))
def _at_run_time(token: torch.Tensor, call: int, tensors: list[torch.Tensor], values: list[int]) -> None:
    """Run the `RunTimeCall` `call` with `tensors` and `values` (the op a graph keeps: it mutates
    `token`, a counter of its calls)."""
    token.add_(1)
    target = _RUN_TIME.get(call)
    if target is not None:
        target.fn([t.clone() for t in tensors], values)  # the graph may reuse their memory


@_at_run_time.register_fake
def _(token: torch.Tensor, call: int, tensors: list[torch.Tensor], values: list[int]) -> None:
    return None


class RunTimeCall:
    """`fn(tensors, values)` run at every call of the code that calls it, eager or compiled: inside
    a graph being traced it is recorded as the `msprobe::at_run_time` op (run with the graph's
    tensors, copied, at run time; `values`, integers, are fixed at trace time)."""

    def __init__(self, fn: Callable[[list[torch.Tensor], list[int]], None]) -> None:
        self.fn = fn
        self.ident = next(_ids)
        self.token = torch.zeros((), dtype=torch.int64)
        _RUN_TIME[self.ident] = self

    def __call__(self, tensors: list[torch.Tensor] = (), values: list[int] = ()) -> None:
        if torch.compiler.is_compiling():
            torch.ops.msprobe.at_run_time(self.token, self.ident, [t.detach() for t in tensors], list(values))
        else:
            self.fn(list(tensors), list(values))


def partial_values(tensor: torch.Tensor, count_zeros: bool) -> dict[str, torch.Tensor]:
    """The partial statistics of `tensor` by column name (0-d tensors), with tensor ops only
    (traceable). Floating tensors of 32 bits or fewer are reduced in float32; the zero count is
    nan unless `count_zeros`; columns not named here (registered ones) are measured eagerly only.
    The nan and inf counts are comparisons (`x != x`, `|x| == inf`): inductor's CPU code vectorizes
    them, where `isnan`/`isinf` fall back to a scalar loop per element (4-5x the whole row's time)."""
    x = tensor.detach()
    x = x.double() if x.dtype == torch.float64 or not x.is_floating_point() else x.float()
    values = {"min": x.amin(), "max": x.amax(), "sum": x.sum(), "sumsq": (x * x).sum(),
              "nan_count": (x != x).sum(), "inf_count": (x.abs() == math.inf).sum(),
              "numel": torch.scalar_tensor(x.numel(), dtype=x.dtype, device=x.device)}
    if count_zeros:
        values["zero_count"] = (x == 0).sum()
    return values


def merge_into(target: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
    """Merge `values` (`partial_values`) into the buffer row `target`, in place (min, max, sums
    as the columns say), as one elementwise expression over the row: no stacked row, so inductor
    makes no view per column (a wrapper call each, at every run of the graph)."""
    column = torch.arange(target.numel(), device=target.device)
    merged = torch.full_like(target, math.nan)  # a column no value is given for
    for i, c in enumerate(columns.columns()):
        value = values.get(c.name)
        if value is None:
            continue
        value = value.to(target.dtype)
        at = column == i
        if c.merge == "min":
            merged = torch.where(at, torch.minimum(target, value), merged)
        elif c.merge == "max":
            merged = torch.where(at, torch.maximum(target, value), merged)
        else:
            merged = torch.where(at, target + value, merged)
    target.copy_(merged)


class _GradTap(torch.autograd.Function):
    """Identity on `x` whose backward merges the gradient's row into `target` (a buffer row);
    `opaque`: the row comes from `opaque_row` (never fused into the gradient's producer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, target: torch.Tensor, count_zeros: bool,
                opaque: bool) -> torch.Tensor:
        ctx.save_for_backward(target)
        ctx.count_zeros = count_zeros
        ctx.opaque = opaque
        return x.clone()  # a new tensor (autograd functions may not return their input); exact

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (target,) = ctx.saved_tensors
        measure = opaque_row.values if ctx.opaque else partial_values
        merge_into(target, measure(grad, ctx.count_zeros))
        return grad, None, None, None


class CompiledCapture:
    """The device rows the traced hooks of one monitor write into, and their names."""

    def __init__(self, monitor: "Monitor", modules: int, device: torch.device, count_zeros: bool,
                 ran_eagerly: Callable[[], bool] | None = None) -> None:
        """`modules`: how many are watched (the buffer's size); `ran_eagerly()`: whether a hook
        ran on the eager path in the step (None: nothing is watched)."""
        self.monitor = monitor
        self.ran_eagerly = ran_eagerly
        self.count_zeros = count_zeros
        self.ident = next(_ids)
        self.slots: dict[MetricKey, int] = {}
        self.capacity = max(1, modules) * ROWS_PER_MODULE
        self._empty = torch.tensor(columns.empty_row(), dtype=torch.float64, device=device)
        #: the row of each name (`slots`) written by the compiled code in this step
        self.buffer = [self._empty.clone() for _ in range(self.capacity)]
        self._harvested = -1
        _CAPTURES[self.ident] = self
        _BY_MONITOR.setdefault(monitor, []).append(self)

    def slot(self, key: MetricKey) -> int:
        """The row of `key` (allocated at first sight, while tracing)."""
        if key not in self.slots:
            if len(self.slots) >= self.capacity:
                self.monitor.warn(f"under torch.compile at most {self.capacity} rows are measured; "
                                  f"{key.path} ({key.role}) is not")
                return -1
            self.slots[key] = len(self.slots)
        return self.slots[key]

    # ---- traced (inside the compiled graph) ----------------------------------------
    def record(self, kind: str, path: str, role: str, tensor: torch.Tensor) -> None:
        i = _slot(self.ident, kind, path, role)
        if i >= 0:
            measure = opaque_row.values if opaque_row.usable(tensor) else partial_values
            merge_into(self.buffer[i], measure(tensor, self.count_zeros))

    def tap(self, kind: str, path: str, role: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, through an identity whose backward measures its gradient."""
        i = _slot(self.ident, kind, path, role)
        if i < 0:
            return tensor
        return _GradTap.apply(tensor, self.buffer[i], self.count_zeros, opaque_row.usable(tensor))

    # ---- outside the graph, once a step --------------------------------------------
    def harvest(self) -> None:
        """Hand this step's rows to the monitor (one device copy) and reset the buffer; forward
        rows in the order they were traced, gradient rows in backward (reversed) order."""
        monitor = self.monitor
        if not self.slots:
            if self.ran_eagerly is not None and not self.ran_eagerly():
                monitor.warn(STALE_GRAPH)
            return
        if self._harvested == monitor.step:
            return
        self._harvested = monitor.step
        forward = [(k, i) for k, i in self.slots.items() if k.kind not in GRAD_KINDS]
        backward = [(k, i) for k, i in reversed(self.slots.items()) if k.kind in GRAD_KINDS]
        order = forward + backward
        written = [self.buffer[i] for _, i in order]
        rows = torch.stack(written)
        torch._foreach_copy_(written, [self._empty] * len(written))
        keys = [k for k, _ in order]
        monitor.rows.add(monitor.step, keys, rows, remember=False, seconds=0.0, measured=len(keys))
