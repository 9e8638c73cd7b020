"""`MindSporePrecisionDebugger`: the dump session for MindSpore (L0 Cells, L1 APIs, mix; PyNative).

::

    debugger = MindSporePrecisionDebugger({"task": "statistics", "dump_path": "./dump", "level": "L0"})
    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)
    for x, y in data:
        debugger.start(net)
        loss, grads = grad_fn(x, y)
        optimizer(grads)
        debugger.stop()
        debugger.step(grads)           # the parameter gradients: a tuple in `net.trainable_params()`
    debugger.close()                   # order (or `params=`), or {parameter name: gradient}

The same config keys and the same session as PyTorch's `PrecisionDebugger` (whose start/stop/
step/close, writer and atomic step directories it inherits); dump.json is in the reference's
MindSpore format (``Cell.`` names, ``"type": "mindspore.Tensor"``, dtypes such as ``Float32``,
no ``requires_grad``), tensors are ``.npy`` files, construct.json (L0, mix) gives each entry's
enclosing Cell, stack.json (``"stack": true``) each forward call's stack. Statistics are computed
by the MindSpore backend; torch is never imported. L1 and mix record API calls
(`capture.apis`) and need PYNATIVE_MODE: in GRAPH_MODE `start` raises `ConfigError`. In GRAPH_MODE
the L0 statistics task takes the Cells' statistics from inside
the compiled graph (`capture.graph_recorder`; `start(net)` before the net's first call).

The debugger tasks, with PyTorch's config keys (`msprobe_engine.dump.tasks`):
``overflow_check`` (L0, L1; `capture.overflow`), ``free_benchmark`` (L1;
`capture.free_benchmark`) and ``grad_probe`` (``debugger.monitor(optimizer)``;
`frameworks.mindspore.grad_probe`), all PyNative only; ``diff_check`` is refused.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump.recorder import RecorderContext, recorder_class, register_recorder, supported_tasks
from msprobe_engine.dump.session import DumpSession, check_names
from msprobe_engine.dump.task import require_support
from msprobe_engine.dump.writer import array_crc32

log = logging.getLogger("msprobe_engine")

FRAMEWORK = "mindspore"
_CAPTURE = "msprobe_engine.frameworks.mindspore.capture"
#: the recorder of each task MindSpore implements (imported when a session of that task starts)
for _task, _recorder in (("statistics", f"{_CAPTURE}.recorder:CellRecorder"),
                         ("tensor", f"{_CAPTURE}.recorder:CellRecorder"),
                         ("overflow_check", f"{_CAPTURE}.overflow:OverflowCellRecorder"),
                         ("free_benchmark", f"{_CAPTURE}.free_benchmark:MindSporeFreeBenchmark"),
                         ("grad_probe", "msprobe_engine.frameworks.mindspore.grad_probe:MindSporeGradProbe")):
    register_recorder(FRAMEWORK, _task, _recorder)
#: the tasks the MindSpore session implements (built in; a plugin's `register_recorder` adds more)
MINDSPORE_TASKS = supported_tasks(FRAMEWORK)
#: the tasks that need PYNATIVE_MODE at any level (their hooks do not run in a compiled graph)
PYNATIVE_TASKS = ("overflow_check", "free_benchmark", "grad_probe")
GRAPH_MODE_WARNING = ("msprobe dump: GRAPH_MODE: Cell hooks do not run in a compiled graph, so no Cell "
                      "entries are dumped; use PYNATIVE_MODE, or the statistics task at L0 (taken inside the graph); "
                      "parameter gradients passed to step() are dumped")


class MindSporePrecisionDebugger(DumpSession):
    """A MindSpore dump session; see the module docstring."""

    framework = FRAMEWORK

    def __init__(self, *args: Any, params: Any = None, **kwargs: Any) -> None:
        """As `PrecisionDebugger`; `params`: the parameters a gradient tuple given to `step`
        follows (default: the net's `trainable_params()`)."""
        super().__init__(*args, **kwargs)
        require_support(self.config.task, "MindSpore", supported_tasks(FRAMEWORK))
        if self.config.task == "free_benchmark":
            from msprobe_engine.frameworks.mindspore.capture.free_benchmark import PYTORCH_ONLY

            if self.config.options.pert_mode in PYTORCH_ONLY:
                raise ConfigError(f"free_benchmark.pert_mode: {self.config.options.pert_mode!r} (with fuzz_device "
                                  "'cpu') is PyTorch's: MindSpore runs every API on its context's device; use "
                                  "improve_precision, add_noise, bit_noise, change_value or no_change")
        if self.config.summary_mode == "xor":
            raise ConfigError("summary_mode: 'xor' is not supported on MindSpore yet; use statistics or md5")
        self._params = list(params) if params is not None else None
        self._apis: Any = None
        self._cell_hooks: list[Any] = []  # one DumpCellHooks per hooked net
        self._owners: dict[int, tuple[str, str]] = {}

    @property
    def task_results(self) -> list:
        """So far: overflow_check (step, first overflowing call) per step that overflowed;
        free_benchmark the failing outputs (`ResultRow`); else []."""
        return list(self._recorder.results) if self._recorder is not None else []

    def monitor(self, optimizer: Any) -> None:
        """grad_probe (the predecessor's MindSpore call): probe the gradients `optimizer` applies
        at each of its steps (no start/stop/step needed; `close()` at the end)."""
        if self.config.task != "grad_probe":
            raise ConfigError(f"monitor(optimizer) is the grad_probe task's call; this config's task is "
                              f"{self.config.task!r}")
        self.start(optimizer)

    def step(self, grads: Any = None) -> None:
        """Close the step; `grads` (optional): its parameter gradients, dumped as parameters_grad."""
        if grads is not None and self._collected and hasattr(self._recorder, "param_grads"):
            self._recorder.param_grads(self._named_grads(grads))
        super().step()

    # ---- the framework layer of PrecisionDebugger ---------------------------------------
    def _setup(self, model: Any) -> None:
        from mindspore import nn

        from msprobe_engine.frameworks.mindspore import backend as mindspore_backend
        from msprobe_engine.frameworks.mindspore.capture.apis import ApiHooks, api_keys, missing_interfaces
        from msprobe_engine.frameworks.mindspore.capture.cells import cell_keys

        task = self.config.task
        recorder = recorder_class(FRAMEWORK, task)
        if _graph_mode() and task == "statistics" and self.config.level == "L0":
            from msprobe_engine.frameworks.mindspore.capture.graph_recorder import GraphCellRecorder
            recorder = GraphCellRecorder  # the Cells' statistics from inside the compiled graph
        if not isinstance(model, nn.Cell):
            what = "an optimizer: monitor(optimizer)" if not recorder.records_calls else "a net: pass it to start(net)"
            raise ConfigError(f"the MindSpore {task} session watches {what} (a mindspore.nn.Cell), "
                              f"got {type(model).__name__}")
        self.rank, world = _rank_and_world()
        self.config.check_ranks(world)
        apis = self.config.level != "L0" and recorder.records_calls
        if (apis or task in PYNATIVE_TASKS) and _graph_mode():
            what = f"task {task!r}" if task in PYNATIVE_TASKS else f"level {self.config.level!r}"
            raise ConfigError(f"{what} needs PYNATIVE_MODE: the context's mode is GRAPH_MODE, "
                              "where no API or Cell call can be watched; call mindspore.set_context(mode="
                              "mindspore.PYNATIVE_MODE) before training" +
                              ("" if task in PYNATIVE_TASKS else ", or use level L0 (parameter gradients)"))
        ctx = RecorderContext(self.config, self.rank, self.writer, self._emit_tensors, mindspore_backend)
        if not recorder.records_calls:
            self._recorder = recorder(ctx)
            self._hooks.append(self._recorder)
            self._hook_model(model)
            return
        missing = missing_interfaces() if apis else []
        if missing:
            raise ConfigError(f"level {self.config.level!r} needs interfaces this MindSpore lacks: "
                              f"{', '.join(missing)}; upgrade MindSpore (2.10 is tested) or use level L0")
        check_names(self.config, cell_keys(model), _Keys(api_keys()) if apis else None)
        self._recorder = recorder(ctx)
        if apis:
            self._apis = ApiHooks(self._recorder, self._recorder.gate,
                                  backward=self._recorder.sel.backward and not recorder.watches_model)
            self._hooks.append(self._apis)
        self._hook_model(model)

    def _hook_model(self, model: Any) -> None:
        from msprobe_engine.frameworks.mindspore.capture.cells import DumpCellHooks

        if not self._recorder.records_calls:
            self._recorder.watch(model)
            self._hooked.add(id(model))
            if hasattr(self._recorder, "param_grads"):  # step(grads) names them as the Cell dump does
                self._own_parameters(model)
            return
        if _graph_mode():
            log.warning(GRAPH_MODE_WARNING)
        sel = self._recorder.sel
        if self._recorder.watches_model:  # APIs only (free_benchmark): no Cell hook
            self._apis.hook_primitives(model)
            self._hooked.add(id(model))
            return
        cells = DumpCellHooks(self._recorder, model, backward=sel.backward, cells=sel.modules)
        self._hooks.append(cells)
        self._cell_hooks.append(cells)
        if self._apis is not None:
            self._apis.hook_primitives(model)
        self._own_parameters(model)
        self._hooked.add(id(model))

    def _own_parameters(self, model: Any) -> None:
        """Which Cell holds each parameter of `model`, and the parameters a gradient tuple follows."""
        from msprobe_engine.frameworks.mindspore.capture.cells import parameter_owners

        self._owners.update(parameter_owners(model))
        if self._params is None:
            self._params = list(model.trainable_params())

    def _activate(self) -> None:
        wanted = self.config.wants_step(self.current_step) and self.config.wants_rank(self.rank or 0)
        if self._running and wanted and self._recorder is not None:
            self._recorder.active = self._collected = True
            for cells in self._cell_hooks:
                cells.install()
            if self._apis is not None:
                self._apis.route_primitives(True)

    def _deactivate(self) -> None:
        """Between dumped steps the nets carry no hook of the dump and their Primitives are their own."""
        if self._recorder is not None:
            self._recorder.active = False
        for cells in self._cell_hooks:
            cells.remove()
        if self._apis is not None:
            self._apis.route_primitives(False)

    def _tensor_writers(self) -> tuple[Any, Any]:
        return (_save_npy if self.config.task_class.saves_tensors else None,
                array_crc32 if self.config.summary_mode == "md5" else None)

    # ---- gradients ------------------------------------------------------------------------
    def _named_grads(self, grads: Any) -> list[tuple[str, str, Any]]:
        """(``Cell.<path>.<Class>``, local name, gradient) of the gradients of known parameters."""
        params = self._params or []
        if isinstance(grads, dict):
            by_name = {p.name: p for p in params}
            pairs = [(by_name.get(k), g) for k, g in grads.items()]
        else:
            grads = list(grads)
            if len(grads) != len(params):
                log.warning("msprobe dump: step() got %d gradients for %d parameters; parameters_grad is not "
                            "dumped (pass params= to the debugger when grads follow other parameters)",
                            len(grads), len(params))
                return []
            pairs = list(zip(params, grads))
        return [(*self._owners[id(p)], g) for p, g in pairs if p is not None and id(p) in self._owners]


class _Keys:
    """The API keys as `check_names` asks for them."""

    def __init__(self, keys: frozenset[str]) -> None:
        self.keys = keys

    def has_key(self, key: str) -> bool:
        return key in self.keys or key.startswith("Primitive.")


def _graph_mode() -> bool:
    import mindspore as ms
    return ms.get_context("mode") == ms.GRAPH_MODE


def _save_npy(array: np.ndarray, path: str) -> None:
    with open(path, "wb") as file:  # a path would get ".npy" appended when it lacks it
        np.save(file, array, allow_pickle=False)


def _rank_and_world() -> tuple[int | None, int]:
    """(rank, world size): from MindSpore's communication when initialised, else from the
    launcher's environment (RANK_ID/RANK_SIZE, or RANK/WORLD_SIZE), else (None, 1)."""
    from mindspore.communication import GlobalComm

    if GlobalComm.INITED:
        from mindspore.communication import get_group_size, get_rank
        return get_rank(), get_group_size()
    world = int(os.environ.get("RANK_SIZE", os.environ.get("WORLD_SIZE", "1")))
    rank = int(os.environ.get("RANK_ID", os.environ.get("RANK", "0")))
    return (rank, world) if world > 1 else (None, 1)
