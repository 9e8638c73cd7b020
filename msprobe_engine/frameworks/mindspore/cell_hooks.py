"""MindSpore collection: Cell activations, parameter gradients and optimizer state.

In PyNative mode, forward hooks on the selected Cells see activations, tensor
hooks on their outputs see the gradients w.r.t. those outputs, and forward
pre/post hooks on the optimizer Cell (which is called with the gradients) mark
the optimizer step. In GRAPH_MODE no Python hook runs, so none is registered:
activations are measured by taps compiled into the graph (`graph_capture`),
gradients are handed over explicitly and the state after the step is read when
the step ends. Inside `mindspore.jit` (in PyNative mode) MindSpore compiles the
hooks of the Cells it compiles: every hook here is wrapped by `jit_safe`, so it
compiles to nothing there (the graph taps measure instead).

Every PyNative op is a trip through MindSpore's dispatch pipeline, so tensors
are not measured one hook at a time: a `TensorBatch` collects them and measures
all of them with one backend call (one compiled graph) at the last moment their
values are known to be unchanged: before the optimizer step when a rule must
decide there, else at step end. The watched outputs stay alive until then.
A parameter's update is measured as a `Difference` from a copy taken before the
optimizer step (one compiled launch for all the copies).

Names are those of the torch side: `actv/<cell path>/output`, `grad/<param>`,
`optim/<param>/exp_avg`, ...; a Cell called k times in a micro-step is
`path`, `path:1`, ... `path:k-1`.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from msprobe_engine.frameworks.mindspore.backend import Difference, Measured
from msprobe_engine.collect.flatten import iter_tensors
from msprobe_engine.collect.selection import ModuleFilter
from msprobe_engine.handles import Handles
from msprobe_engine.incident.graph import INPUT_GRAD_KIND, INPUT_KIND
from msprobe_engine.stats.table import MetricKey

if TYPE_CHECKING:
    from msprobe_engine.incident.graph import CallGraph
    from msprobe_engine.monitor import Monitor


def jit_safe(action: Callable[..., None]) -> Callable[..., None]:
    """A Cell hook that calls `action`.

    When MindSpore compiles the Cell (GRAPH_MODE, `mindspore.jit`) it compiles this
    body but does not look inside a `functools.partial`: the call is dropped and the
    hook visibly returns None, so the Cell's inputs and outputs are left alone.
    In PyNative mode it simply calls `action`.
    """
    opaque = partial(action)

    def hook(*args: Any) -> None:
        opaque(*args)

    return hook


#: the dtypes that have gradients
FLOATING = (ms.float16, ms.bfloat16, ms.float32, ms.float64)


def is_tensor(value: Any) -> bool:
    return isinstance(value, Tensor)


def compiled() -> bool:
    """True in GRAPH_MODE, where Cell hooks never run."""
    return ms.get_context("mode") == ms.GRAPH_MODE


class TensorBatch:
    """(key, tensor) pairs waiting to be measured together with one backend call.

    Adding reads nothing of the tensors (in PyNative mode even a shape read waits
    for the queued device work); the references keep them alive until `flush`.
    """

    def __init__(self, monitor: "Monitor") -> None:
        self.monitor = monitor
        self.keys: list[MetricKey] = []
        self.tensors: list[Measured] = []

    def add(self, keys: Sequence[MetricKey], tensors: Sequence[Measured]) -> None:
        self.keys += keys
        self.tensors += tensors

    def flush(self) -> None:
        """Measure everything collected so far (device-side; no host transfer)."""
        if self.keys:
            self.monitor.add_tensors(self.keys, self.tensors)
        self.keys, self.tensors = [], []


def watched_cells(monitor: "Monitor", net: nn.Cell) -> list[tuple[str, nn.Cell]]:
    """The (path, Cell) pairs of `net` whose activations the config watches (none when no
    activation is wanted; never the root, whose output is the loss or the logits). Records every
    Cell's class for incidents and warns about selected names that do not exist."""
    names = dict(net.cells_and_names())
    if monitor.graph is not None:  # cell classes, for incidents (parameter gradients need them too)
        monitor.graph.classes.update((path, type(cell).__name__) for path, cell in names.items())
    watch = monitor.config.watch
    if not (watch.module_inputs or watch.module_outputs or watch.activation_grads):
        return []
    wanted = ModuleFilter(monitor.config.modules)
    monitor.warn_unmatched("modules.names", wanted.unmatched_names(set(names)))
    return [(path, cell) for path, cell in names.items() if path and wanted(path, type(cell).__name__)]


class CellHooks(Handles):
    """Forward hooks on the watched Cells `cells` of `net` (`watched_cells`), and gradient hooks
    on their outputs. With `graph` (a replay's hooks), what each call read goes into it (`_note`),
    so that a replay names the culprit of a backward anomaly (`incident.culprit`)."""

    def __init__(self, monitor: "Monitor", net: nn.Cell, cells: list[tuple[str, nn.Cell]],
                 batch: TensorBatch, graph: "CallGraph | None" = None) -> None:
        self.monitor = monitor
        self.batch = batch
        self.graph = graph
        watch = monitor.config.watch
        self.inputs = watch.module_inputs
        self.outputs = watch.module_outputs
        self.grads = watch.activation_grads
        self.calls: dict[str, int] = defaultdict(int)
        self.fired = False
        self.handles: list = [net.register_forward_pre_hook(jit_safe(self._root_pre_hook))]
        self.paths = [path for path, _ in cells]
        for path, cell in cells:
            hook = jit_safe(partial(self._on_forward, path))
            self.handles.append(cell.register_forward_hook(hook, with_kwargs=True))

    def _root_pre_hook(self, cell: nn.Cell, args: tuple) -> None:
        self.calls.clear()
        self.fired = True
        self.monitor.micro_step_begin()

    def _on_forward(self, path: str, cell: nn.Cell, args: tuple, kwargs: dict, output: Any) -> None:
        where = f"forward hook of {path}"
        if not self.monitor.active or where in self.monitor.disabled:
            return
        with self.monitor.guard(where):
            n = self.calls[path]
            self.calls[path] = n + 1
            self._collect(path if n == 0 else f"{path}:{n}", args, kwargs, output)

    def _collect(self, name: str, args: tuple, kwargs: dict, output: Any) -> None:
        found = list(iter_tensors(output, "output", is_tensor))
        keys: list[MetricKey] = []
        tensors: list[Tensor] = []
        if self.outputs:
            keys += [MetricKey("actv", name, role) for role, _ in found]
            tensors += [t for _, t in found]
        if self.inputs:
            inputs = dict([*enumerate(args), *kwargs.items()])
            for role, t in iter_tensors(inputs, "input", is_tensor):
                keys.append(MetricKey("actv", name, role))
                tensors.append(t)
        self.batch.add(keys, tensors)
        if self.graph is not None:
            self._note(name, args)
        if self.grads:
            for role, t in found:
                t.register_hook(partial(self._on_grad, MetricKey("actv_grad", name, role)))

    def _note(self, name: str, args: tuple) -> None:
        """Into `graph`: the rows of what call `name` read (its positional inputs, hidden
        ``actv_in`` rows unless inputs are watched), and gradient hooks on those inputs (hidden
        ``actv_in_grad`` rows): the first bad one in backward order names the call whose backward
        made it (tensor identity cannot link a Cell's output to its reader's input here: a
        backward hook on a Cell, such as a tensor dump's, gives its reader a copy)."""
        reads = {}
        for role, t in iter_tensors(dict(enumerate(args)), "input", is_tensor):
            reads[role] = MetricKey("actv" if self.inputs else INPUT_KIND, name, role)
            if t.dtype in FLOATING:
                t.register_hook(partial(self._on_grad, MetricKey(INPUT_GRAD_KIND, name, role)))
        self.graph.reads[name] = reads

    def _on_grad(self, key: MetricKey, grad: Tensor) -> Tensor:
        where = f"gradient hook of {key.path}"
        if self.monitor.active and where not in self.monitor.disabled:
            with self.monitor.guard(where):
                self.batch.add([key], [grad])
        return grad  # MindSpore tensor hooks must return the gradient


def known_state(optimizer: Any) -> dict[str, str]:
    """{optimizer attribute holding per-parameter state: the name we report} for the
    optimizers whose state we know (Adam/AdamW families, Momentum); {} otherwise."""
    from mindspore import mint
    from mindspore.experimental import optim

    moments = {"moment1": "exp_avg", "moment2": "exp_avg_sq"}
    torch_like = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    table = [
        ((nn.Adam, nn.LazyAdam), moments),
        ((nn.AdamWeightDecay,), {"moments1": "exp_avg", "moments2": "exp_avg_sq"}),
        ((optim.Adam, optim.AdamW, mint.optim.Adam, mint.optim.AdamW, mint.optim.FusedAdamW), torch_like),
        ((nn.Momentum,), {"moments": "exp_avg"}),
    ]
    for classes, names in table:
        if isinstance(optimizer, classes):
            return names
    return {}


HeldState = list[tuple[Parameter, Tensor]]


class OptimizerState(Handles):
    """Gradients before, and parameters, optimizer state and update after each optimizer step.

    With `hooks`, forward pre/post hooks on the optimizer Cell call `before_step` and
    `after_step` (PyNative); otherwise the integration calls them at step end.

    A rule's `skip`: MindSpore has no way to keep an optimizer Cell that is called from
    running, so when the decision (made in the pre-hook, before the weights change) says
    skip, the pre-hook copies every Parameter of the optimizer Cell (the weights, the
    moments, `global_step`/`state_step`, beta powers: one compiled launch) and the post-hook
    assigns the copies back. The step then leaves no trace, as torch's skipped step.
    Only skipped steps pay for it.
    """

    def __init__(self, monitor: "Monitor", net: nn.Cell, optimizer: Any,
                 batch: TensorBatch, hooks: bool) -> None:
        self.monitor = monitor
        self.batch = batch
        watch = monitor.config.watch
        self.update = any(s in ("update", "ratio") for s in watch.optimizer_state)
        self.read_params = watch.params or self.update
        paths = {id(p): name for name, p in net.parameters_and_names()}
        owned = list(optimizer.parameters) if optimizer is not None else net.trainable_params()
        self.order = [paths.get(id(p)) for p in owned]  # grads arrive in this order; None: not in the net
        self.params = [(paths[id(p)], p) for p in owned if id(p) in paths]
        self.by_name = {p.name: path for path, p in self.params}
        self.states = self._states(optimizer, watch.optimizer_state) if optimizer is not None else []
        self.stepped = False
        self.optimizer = optimizer
        self._held: HeldState = []
        self._before: tuple[Tensor, ...] | None = None
        #: called first in the optimizer's pre-hook (the wiring takes a compiled forward's rows)
        self.before_grads: Callable[[], None] = lambda: None
        self.handles: list = []
        foreign = self.order.count(None)
        if foreign:
            monitor.warn(f"{foreign} optimizer parameters are not in the net; they are not monitored")
        if hooks and optimizer is not None:
            self.handles = [optimizer.register_forward_pre_hook(jit_safe(self._pre_hook)),
                            optimizer.register_forward_hook(jit_safe(self._post_hook))]

    def before_step(self, grads: Any, hooked: bool = False) -> None:
        """At the accumulation boundary: measure `grads` (a tuple in optimizer-parameter
        order, or a {parameter name: grad} dict; None: not known). `hooked`: called by the
        optimizer's pre-hook, before the step (so a `skip` can be applied)."""
        monitor = self.monitor
        if monitor.active:
            with monitor.guard("optimizer pre-step"):
                self.measure_grads(grads)
                if monitor.decide_early or getattr(monitor.replay_host, "step_call", False):
                    self.batch.flush()  # the decision comes now
        self.stepped = True
        if monitor.before_optimizer_step().skip:  # a `stop` rule raises out of it instead
            if hooked:
                self._held = self.optimizer_state()
            else:
                monitor.warn("a rule asked to skip the optimizer step, but the step ran compiled (no optimizer "
                             "hook ran) or without an optimizer; it was applied, unless a FiniteGate around the "
                             "optimizer skipped it inside the graph (non-finite gradients)")

    def measure_grads(self, grads: Any) -> None:
        """The parameter gradients `grads` (see `before_step`) into the step's batch, when watched."""
        if self.monitor.config.watch.param_grads and grads is not None:
            named = self._named_grads(grads)
            self.batch.add([MetricKey("grad", n) for n, _ in named], [g for _, g in named])

    def optimizer_state(self) -> HeldState:
        """Copies of every Parameter of the optimizer Cell (weights, moments, step counters)."""
        return held_copies([p for _, p in self.optimizer.parameters_and_names()])

    def after_step(self, read: bool = True) -> None:
        """After the optimizer step: parameters, optimizer state and the update (unless not `read`:
        measured elsewhere). A skipped step is undone first: every Parameter of the optimizer
        gets its copy back (bitwise)."""
        monitor = self.monitor
        if self._held:
            held, self._held = self._held, []
            for param, copy in held:
                ops.assign(param, copy)
        if monitor.active and read:
            with monitor.guard("optimizer post-step"):
                self.read_after_step()
        monitor.after_optimizer_step()

    def snapshot(self) -> None:
        """Copy the parameters (when this step is monitored and the update is wanted),
        to measure the update of the coming optimizer step."""
        if self.update and self.params and self.monitor.active:
            self._before = parameter_copies(ms.mutable(tuple(p for _, p in self.params)))

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """While a step is replayed: the real step's `stepped` and update snapshot kept aside, the
        replay gets its own."""
        held = self.stepped, self._before
        self.stepped = False
        self.snapshot()
        try:
            yield
        finally:
            self.stepped, self._before = held

    def _pre_hook(self, cell: nn.Cell, args: tuple) -> None:
        self.before_grads()
        with self.monitor.guard("optimizer pre-step"):
            self.snapshot()
        self.before_step(args[0] if args else None, hooked=True)

    def _post_hook(self, cell: nn.Cell, args: tuple, output: Any) -> None:
        self.after_step()

    def _named_grads(self, grads: Any) -> list[tuple[str, Tensor]]:
        if isinstance(grads, dict):
            return [(self.by_name[k], g) for k, g in grads.items() if k in self.by_name and is_tensor(g)]
        grads = list(grads or ())
        if len(grads) != len(self.order):
            self.monitor.warn(f"got {len(grads)} gradients for {len(self.order)} parameters; "
                              "gradients are not monitored")
            return []
        return [(n, g) for n, g in zip(self.order, grads) if n is not None and is_tensor(g)]

    def read_after_step(self) -> None:
        """The parameters, optimizer state and update after the optimizer step, into the batch."""
        keys: list[MetricKey] = []
        tensors: list[Measured] = []
        if self.read_params:
            keys += [MetricKey("param", n) for n, _ in self.params]
            tensors += [p for _, p in self.params]
        for role, values in self.states:
            keys += [MetricKey("optim", n, role) for n, _ in values]
            tensors += [v for _, v in values]
        if self._before is not None:
            keys += [MetricKey("optim", n, "update") for n, _ in self.params]
            tensors += [Difference(p, before) for (_, p), before in zip(self.params, self._before)]
            self._before = None
        self.batch.add(keys, tensors)

    def _states(self, optimizer: Any, wanted: list[str]) -> list[tuple[str, list[tuple[str, Parameter]]]]:
        wanted_states = [s for s in wanted if s in ("exp_avg", "exp_avg_sq")]
        names = known_state(optimizer)
        if wanted_states and not names:
            self.monitor.warn(f"the state of optimizer {type(optimizer).__name__} is not known; "
                              f"{', '.join(wanted_states)} are not monitored (known: Adam, AdamWeightDecay, "
                              "LazyAdam, Momentum, experimental/mint Adam and AdamW)")
        states = []
        for attr, role in names.items():
            if role in wanted_states:
                values = list(getattr(optimizer, attr))
                states.append((role, [(n, v) for n, v in zip(self.order, values) if n is not None]))
        return states


def held_copies(params: list[Parameter]) -> HeldState:
    """(Parameter, a copy of its value) for each of `params` (one compiled launch)."""
    return list(zip(params, parameter_copies(ms.mutable(tuple(params))))) if params else []


@ms.jit
def parameter_copies(params):
    """Copies of `params` (one compiled launch; eager copies cost one dispatch each)."""
    return tuple(ops.deepcopy(p) for p in params)

