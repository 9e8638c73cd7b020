"""The step lifecycle every integration maps its framework onto, and what a framework provides.

`StepLifecycle` is the contract between an integration (plain PyTorch, DeepSpeed,
Megatron-core, MindSpore, the trainer callbacks) and the engine: the calls arrive in
this order on every optimizer step, and `Monitor` implements them::

    micro_step_begin()                 once per micro-batch (forward of the root module)
    add_tensors(keys, tensors)         any number of times; device-side only
    before_optimizer_step() -> StepDecision
                                       at the accumulation boundary, gradients final;
                                       raises TrainingStopped on `stop`
    after_optimizer_step()             the framework's optimizer step ran (or was skipped)
    step_end(loss)                     closes the step: one record to the sinks
    ...
    close()                            once, at the end of training

`state_dict()` / `load_state_dict()` carry the step, the rules' state and the incident
counters across a restart. `Integration` is the small base of the adapters: it holds the
monitor, forwards the facade users call, and guards each call it makes so an error inside
the tool never stops the training (strict mode re-raises).

`MonitorPort` is the part of the `Monitor` the adapters (integrations and the frameworks'
hooks) may use: the lifecycle, the reporting calls, the error policy and the few attributes
they read. `Framework` is what a framework package (`msprobe_engine.frameworks.<name>.adapter`)
provides to the core: its names, its statistics backend, the hooks `Monitor.attach` installs,
the replay host, its dump session, tensor-file loading, the host copier and the API pre-check.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol, Sequence

if TYPE_CHECKING:
    import numpy as np

    from msprobe_engine.config.schema import MonitorConfig
    from msprobe_engine.handles import Removable
    from msprobe_engine.incident.actions import StepDecision
    from msprobe_engine.incident.graph import CallGraph
    from msprobe_engine.incident.replay import ReplayHost
    from msprobe_engine.records import StepRecord
    from msprobe_engine.reducer import Reducer
    from msprobe_engine.sinks import BackgroundWriter
    from msprobe_engine.stats.table import MetricKey, StatTable

#: the lifecycle calls, in the order they arrive within one optimizer step
LIFECYCLE = ("micro_step_begin", "add_tensors", "before_optimizer_step", "after_optimizer_step", "step_end",
             "close")


class StepLifecycle:
    """The calls an integration makes, in the order of `LIFECYCLE` (see the module docstring).
    Every method is a no-op here; `Monitor` implements them."""

    def micro_step_begin(self) -> None:
        """A micro-batch starts (once per forward of the root model); closes a step left open
        (its optimizer step ran but `step_end` was not called)."""

    def add_tensors(self, keys: Sequence["MetricKey"], tensors: Sequence[Any], divisor: float = 1.0, *,
                    same: Sequence["MetricKey | None"] = (), later: bool = False) -> None:
        """Measure `tensors` (named by `keys`) on their device; nothing reaches the host. `divisor`
        (> 0, e.g. an fp16 loss scale still in the gradients; a number, or a 0-d tensor on the
        tensors' device, read there without a host sync) divides every value, exactly. `same`,
        when given, has one entry per tensor: None, or the key of an earlier row of that very
        tensor, unchanged since, added in this step (or this call) by a call that gave `same`
        too, with the same divisor; that row is repeated instead of measuring the tensor again
        (the backend's `pick`). `later`: a forward hook's tensors, which the backend may measure
        with the micro-step's others at its end when they stay unchanged until then (the torch
        backend's `later_rows`, CPU tensors; the rows are the same)."""

    def before_optimizer_step(self, screen: Callable[["StatTable"], "StatTable"] | None = None) -> "StepDecision":
        """At the accumulation boundary, gradients final: the decision for the optimizer step
        (skip it when `decision.skip`, always during a replay). When a rule's action needs a
        decision before the weights change (skip/stop), or the step runs through `run_step`, the
        step's statistics are transferred and evaluated here. A firing `stop` rule flushes every
        writer and raises `TrainingStopped`. `screen`, when given, gets the step's (reduced) table
        before the rules and returns the table the rules and the record see (e.g. without the
        gradients of an fp16 overflow step, which the framework skips by itself)."""
        raise NotImplementedError

    def after_optimizer_step(self) -> None:
        """The framework's optimizer step has run (or was skipped as decided)."""

    def step_end(self, loss: Any = None) -> "StepRecord | None":
        """Close the optimizer step: one host transfer, the rules, one record to the sinks (None
        when the record waits for the next transfer, or the step is not monitored)."""

    def close(self) -> None:
        """End of training: emit what is pending, flush and close every sink, remove the hooks."""

    def state_dict(self) -> dict[str, Any]:
        """The run's state to save with a checkpoint (plain Python types; `torch.save`-able): the
        step, every rule's running state, open alert episodes and incident counters."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned: the run goes on from the saved step with the same
        rule state (running averages, open episodes) and incident counters."""


class StepCloser(Protocol):
    """Framework wiring with work at each step's end (`MonitorPort.add_step_closer`), e.g. measuring
    the step's tensors together."""

    def close_step(self, loss: Any) -> Any:
        """First in `step_end(loss)`: returns the loss `step_end` still reports (None: none)."""

    def step_closed(self) -> None:
        """Last in `step_end`: the next step begins."""


class MonitorPort(Protocol):
    """The `Monitor` as the adapters see it: exactly the members integrations and the frameworks'
    hooks use. Everything else of the monitor is its own."""

    config: "MonitorConfig"
    rank: int
    #: the current optimizer step, and whether it is monitored (hooks return at once when not)
    step: int
    active: bool
    #: a rule can skip or stop: the decision comes before the optimizer step
    decide_early: bool
    #: the statistics backend; the reducer merging the rows over process groups (None: one process)
    backend: Any
    reducer: "Reducer | None"
    #: hook places switched off after an error (`guard`)
    disabled: set[str]
    #: the call graph the module hooks fill when incidents are on (None otherwise)
    graph: "CallGraph | None"
    #: (dtype, shape, requires_grad) of the tensors measured, by key, for incidents' dump.json
    tensor_meta: dict["MetricKey", tuple]
    #: the one writer thread
    writer: "BackgroundWriter"
    #: called with each step's record
    step_end_listeners: list[Callable[["StepRecord"], None]]

    @property
    def replaying(self) -> bool:
        """True while a step is replayed: hooks leave the real step's state alone."""

    @property
    def replay_host(self) -> "ReplayHost | None":
        """The framework side of a replay (None: steps are not replayed)."""

    # the lifecycle (`StepLifecycle`)
    def micro_step_begin(self) -> None: ...
    def add_tensors(self, keys: Sequence["MetricKey"], tensors: Sequence[Any], divisor: float = 1.0, *,
                    same: Sequence["MetricKey | None"] = (), later: bool = False) -> None: ...
    def before_optimizer_step(self, screen: Callable[["StatTable"], "StatTable"] | None = None
                              ) -> "StepDecision": ...
    def after_optimizer_step(self) -> None: ...
    def step_end(self, loss: Any = None) -> "StepRecord | None": ...
    def close(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    # reporting and the step's rows
    def report_loss(self, loss: Any) -> None: ...
    def report_grad_norm(self, value: Any, max_norm: float | None = None) -> None: ...
    def discard(self, kind: str) -> None: ...
    def run_step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...
    def drain(self) -> None: ...
    def flush(self) -> None: ...

    # wiring
    @property
    def attachments(self) -> tuple["Removable", ...]:
        """What is installed for this monitor (`add_attachment`, `Monitor.attach`)."""

    def add_attachment(self, *attachments: "Removable") -> None: ...
    def add_step_closer(self, closer: StepCloser) -> None: ...
    def forgo_replay(self, reason: str) -> None: ...

    # the error policy (`hook_errors.HookErrors`)
    def guard(self, where: str) -> ContextManager[None]:
        """Context manager around a hook body: an error is logged once and `where` disabled
        (strict mode re-raises)."""

    def hook_failed(self, where: str, exc: Exception) -> None:
        """What `guard` does, from a hot hook's own ``except`` clause."""

    def warn(self, message: str) -> None:
        """Log `message` as a warning, once."""

    def warn_unmatched(self, key: str, names: list[str]) -> None:
        """Warn once that the modules `names` of config `key` do not exist."""


class Framework(Protocol):
    """What a framework package gives the core (`registry.load_framework(name)`); its registration
    (`registry.register_framework`) says the same `name` and `dump_format`."""

    #: the registry's name (e.g. "torch")
    name: str
    #: the `framework` field of its dumps (the predecessor's name, e.g. "pytorch")
    dump_format: str
    #: the statistics backend module (partial_stats, concat, to_host, scalar, pick; the torch one also difference_stats)
    backend: Any

    def attach(self, monitor: MonitorPort, model: Any, optimizer: Any) -> list["Removable"]:
        """Install the hooks that feed `monitor` from `model` (and `optimizer`); returns objects
        with a `remove()` method."""

    def replay_host(self) -> "ReplayHost | None":
        """The framework side of a step replay (None: this framework cannot replay)."""

    def dump_session(self) -> type:
        """The framework's `PrecisionDebugger` class (a `dump.session.DumpSession`)."""

    def load_tensor_file(self, file: Path, mapped: bool = False) -> Any:
        """A tensor file of one of its dumps (the registration's `tensor_suffix`), as an array-like
        (`mapped`: paged in from the file as it is read)."""

    def numpy_copier(self, buffer: "np.ndarray") -> Callable[[int, Any], None]:
        """A function copying one of its 1-D tensors into row `i` of `buffer` (float64)."""

    def precheck(self) -> Any:
        """Its side of the API pre-check (`run_ut`): the module replaying recorded API calls."""


class Integration:
    """Base of the adapters: holds the `Monitor` and forwards its facade (`step_end`, `close`,
    `flush`, `state_dict`, `load_state_dict`, `history`, `incidents`, ...), so an adapter
    adds only what its framework needs. Adapters call the monitor's lifecycle (`StepLifecycle`)
    from their framework's hooks, inside `self.guarded(...)` where an error could escape."""

    monitor: MonitorPort

    def __init__(self, monitor: MonitorPort) -> None:
        self.monitor = monitor

    def __getattr__(self, name: str) -> Any:
        if name == "monitor":  # not set yet (during __init__)
            raise AttributeError(name)
        return getattr(self.monitor, name)

    def guarded(self, where: str):
        """Context manager: an error inside is logged once and disabled (strict mode re-raises)."""
        return self.monitor.guard(where)

    def step_end(self, loss: Any = None) -> "StepRecord | None":
        return self.monitor.step_end(loss)

    def flush(self) -> None:
        self.monitor.flush()

    def close(self) -> None:
        self.monitor.close()

    def state_dict(self) -> dict[str, Any]:
        return self.monitor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state)

    def __enter__(self) -> "Integration":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
