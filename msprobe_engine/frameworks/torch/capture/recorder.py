"""The training-thread side of the dump: names calls, builds entry skeletons, collects gradients.

Module hooks (L0, mix) and the API mode (L1, mix) call into one `Recorder`. Per step it keeps
the entries in execution order (a forward entry when its call returns, a backward entry when
its gradients have arrived), the module nesting (construct.json), call stacks on request,
and the tensors' statistics rows in a `StatBuffer`. `finish_step()` makes the step's one
host transfer and hands everything over; the JSON is built on the writer thread.

Names follow the predecessor (mindstudio-probe 26.2): ``Module.<path>.<Class>.forward.<n>`` /
``.backward.<n>`` / ``.parameters_grad.<n>`` (1.x: no counter), ``<Prefix>.<api>.<n>.forward`` /
``.backward``, Tensor operators by their dunder (``Tensor.__add__``); counters restart every
step and count every call made while collecting, dumped or not, so names are stable under
``list`` and ``scope``. Calls during a backward pass (checkpoint recomputation) are skipped.
"""
from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Any, Callable

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed: no DTensor to meet
    DTensor = ()

from msprobe_engine.collect.flatten import iter_tensors
from msprobe_engine.frameworks.torch.capture.api import (ApiCatalog, ApiInfo, risk_allows, writes_unknown,
                                                         written_tensors)
from msprobe_engine.frameworks.torch.capture.call_shape import as_called
from msprobe_engine.frameworks.torch.capture.call_stack import CallStacks
from msprobe_engine.frameworks.torch.capture.backward import (GradCall, Rewrites, after_call, before_call,
                                                              in_backward, sequence_nr)
from msprobe_engine.frameworks.torch.capture.checksum import checksum_text, fold, xor_words
from msprobe_engine.dump.entry import UNHANDLED, TensorSlot, describe
from msprobe_engine.dump.recorder import DumpRecorder, RecorderContext
from msprobe_engine.dump.select import Selection, Want
from msprobe_engine.frameworks.torch.capture.stat_buffer import StatBuffer
from msprobe_engine.dump.writer import StackNode, StepData, array_crc32

log = logging.getLogger("msprobe_engine")

#: tensor copies (tensor task, md5) are handed to the writer in batches of about this size
TENSOR_BATCH_BYTES = 16 << 20
TENSOR_BATCH_COUNT = 64

TensorItems = list[tuple[TensorSlot, torch.Tensor]]


class _Call:
    """One module or API call being recorded."""
    __slots__ = ("module", "key", "forward", "backward", "want", "keep", "parent", "inputs", "edges", "frames",
                 "onto_output")

    def __init__(self, module: Any, key: str, forward: str, backward: str, want: Want, keep: bool,
                 parent: str | None) -> None:
        self.module, self.key, self.forward, self.backward = module, key, forward, backward
        self.want, self.keep, self.parent = want, keep, parent
        self.inputs: tuple[Any, Any] | None = None
        self.edges = None
        self.frames: StackNode | None = None
        #: an in-place API call writing into a module's output (see `Recorder._api_backward_done`)
        self.onto_output = False


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for _, t in iter_tensors(value, "", _is_tensor, depth=8)]


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The tensor the predecessor hooks for an API's backward: the output, or the first item
    (first value of a dict) going down."""
    for _ in range(8):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, dict):
            value = next((v for v in value.values() if isinstance(v, torch.Tensor)), None)
        elif isinstance(value, (list, tuple)) and value:
            value = value[0]
        else:
            return None
    return None


def _as_list(output: Any) -> list[Any]:
    return list(output) if isinstance(output, tuple) else [output]


def _backward_name(forward: str | None) -> str | None:
    if forward is None:
        return None
    head, _, tail = forward.rpartition(".forward")
    return f"{head}.backward{tail}"


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """dump.json's ``dtype`` of `dtype` (``torch.float32``)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


#: the quantized dtypes (their tensors get no statistics)
_QUANTIZED = frozenset(getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                       if hasattr(torch, name))
#: dtype -> the kind of its strided, non-empty tensors on a real device (read on every recorded tensor)
_DTYPE_KINDS: dict[torch.dtype, str] = {}


def tensor_kind(tensor: torch.Tensor) -> str:
    """Which statistics `tensor` gets: 'float', 'int', 'bool', or 'none' (empty, not strided, meta, quantized)."""
    dtype = tensor.dtype
    kind = _DTYPE_KINDS.get(dtype)
    if kind is None:
        kind = _DTYPE_KINDS[dtype] = ("none" if dtype in _QUANTIZED else "bool" if dtype == torch.bool
                                      else "float" if dtype.is_floating_point or dtype.is_complex else "int")
    if kind != "none" and (tensor.layout != torch.strided or tensor.is_meta or tensor.numel() == 0):
        return "none"
    return kind


class _Guard:
    """The context of `Recorder._hook` (a class: hooks run thousands of times per step)."""
    __slots__ = ("recorder", "where", "name", "disabled")

    def __init__(self, recorder: "Recorder", where: str, name: str) -> None:
        self.recorder, self.where, self.name = recorder, where, name
        self.disabled = torch._C.DisableTorchFunction()

    def __enter__(self) -> None:
        self.recorder._lock.acquire()
        self.disabled.__enter__()

    def __exit__(self, kind, exc, traceback) -> bool:
        self.disabled.__exit__(kind, exc, traceback)
        self.recorder._lock.release()
        return isinstance(exc, Exception) and self.recorder._failed(self.where, self.name, exc)


class Recorder(DumpRecorder):
    """Collects one step at a time; `active` is switched by the session (start/stop)."""

    #: whether slots may be shared by the records of one tensor value (False where a slot is
    #: written after its call: a held tensor's data_name, a diff_check md5)
    shares_slots = True
    #: at L0, the tensors of each module hook are measured at that hook and an output written in
    #: place after its call is found by its version at the backward hook, so L0 runs without the
    #: API mode (~3.5 us per torch call)
    measures_at_hooks = True

    def __init__(self, ctx: RecorderContext) -> None:
        """`ctx.operators`: the `OperatorNames` telling ``x + y`` (``Tensor.__add__``) from ``x.add(y)``."""
        super().__init__(ctx)
        config = ctx.config
        self.operators = ctx.operators
        self.sel = Selection(config)
        self._eager = config.level == "L0" and self.measures_at_hooks
        self.stats = StatBuffer(ctx.backend, deferred=self._eager)
        self.catalog: ApiCatalog = ctx.catalog
        self.emit_tensors = ctx.emit_tensors
        self.save_tensors = config.task == "tensor"
        self.copies = self.save_tensors or config.summary_mode == "md5"
        self.xor = config.summary_mode == "xor"  # on-device checksums, read with the statistics
        #: a tensor value recorded again (same object, same version: the same row) gets the same
        #: slot, unless slots are written later (copies: data_name and md5; xor: md5)
        self._share = self.shares_slots and not (self.copies or self.xor)
        self.active = False
        self._lock = threading.RLock()
        self._step_id = 0
        self._stacks = CallStacks()
        self._recorded: dict[int, tuple[ApiInfo, bool]] = {}  # id(info) -> (info, recorded): `_records`
        self._reset()

    # ---- per step ----------------------------------------------------------------------
    def _reset(self) -> None:
        self.entries: dict[str, Any] = {}
        self.construct: dict[str, str | None] = {}
        self.stacks: dict[str, StackNode] | None = {} if self.config.stack else None
        self._stacks.clear()
        self._counters: dict[str, int] = {}
        self._modules: list[_Call] = []
        self._ran: dict[str, Want | None] = {}  # modules run this step -> the expanded module around
        self._grad_calls: list[GradCall] = []
        self._rewrites = Rewrites()
        self._api_hooks: list = []  # node hooks of API backwards (removed at step end)
        self._grad_index: dict[str, list] = {}  # module -> [parameters_grad counter, its first parameter]
        self._items: TensorItems = []
        self._item_bytes = 0
        self._checksums: list[tuple[TensorSlot, torch.Tensor]] = []
        self._row_slots: dict[int, TensorSlot] = {}  # row -> its slot (`_share`)
        self._flush_task: int | None = None
        self.sel.new_step()
        self.stats.reset()

    def finish_step(self) -> StepData:
        """Close the step: pending gradients, the one host transfer; a fresh step follows
        (also when this raises)."""
        try:
            with self._hook("step end"):
                for call in list(self._grad_calls):
                    call.finish()
                for handle in self._api_hooks:
                    handle.remove()
            with torch._C.DisableTorchFunction():
                host = self.stats.to_host()
                self._read_checksums()
            self._emit()
            return StepData(self.entries, self.construct, self.stacks, host)
        finally:
            self._step_id += 1
            self._reset()

    @property
    def transfers(self) -> int:
        return self.stats.transfers

    # ---- errors ------------------------------------------------------------------------
    def _hook(self, where: str, name: str = "") -> "_Guard":
        """Guard a hook body: serialised, its torch calls unseen by torch-function modes (ours
        included); an error is logged once per `where` and skipped (strict: raised)."""
        return _Guard(self, where, name)

    def _failed(self, where: str, name: str, exc: Exception) -> bool:
        """Record a hook error; True when it is swallowed (not strict)."""
        return self.skipped(where, exc, f"msprobe dump: error in {where} {name}")

    # ---- tensors -----------------------------------------------------------------------
    def _read_checksums(self) -> None:
        """summary_mode xor: the step's checksums read to the host (one copy of every tensor's folded
        words, one of the 0-dim tensors' values) into their slots' md5."""
        words = [(slot, w) for slot, w in self._checksums if w.dim() == 1]
        if words:
            for (slot, _), value in zip(words, fold(torch.stack([w for _, w in words]).to("cpu").numpy())):
                slot.md5 = checksum_text(value)
        scalars = [(slot, v) for slot, v in self._checksums if v.dim() == 0]
        for floating in (False, True):
            found = [(slot, v) for slot, v in scalars if v.is_floating_point() == floating]
            if found:
                kind = torch.float64 if floating else torch.int64
                for (slot, _), value in zip(found, torch.stack([v.to(kind) for _, v in found]).to("cpu").tolist()):
                    slot.md5 = checksum_text(value)

    def _leaf(self, value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self._slot(value, name)
        if isinstance(value, torch.Size):
            return {"type": "torch.Size", "value": list(value)}
        if isinstance(value, (torch.dtype, torch.device)):
            return {"type": f"torch.{type(value).__name__}", "value": str(value)}
        if type(value).__name__ in ("ReduceOp", "RedOpType"):
            return {"type": "torch.distributed.ReduceOp", "value": str(value)}
        return UNHANDLED

    def _slot(self, tensor: torch.Tensor, name: str) -> TensorSlot:
        if isinstance(tensor, DTensor):  # FSDP2/TP: each rank's dump holds its own piece (no collective)
            tensor = tensor.to_local()
        kind = tensor_kind(tensor)
        dtype = tensor.dtype
        row = -1
        if kind != "none":
            row = self.stats.row(tensor.abs() if dtype.is_complex else tensor)
            if self._share:
                known = self._row_slots.get(row)
                if known is not None and known.requires_grad == tensor.requires_grad:
                    return known
        copied = self.copies and not tensor.is_meta
        slot = TensorSlot(dtype_name(dtype), tuple(tensor.shape), tensor.requires_grad, kind, row,
                          f"{name}.pt" if copied and self.save_tensors else None)
        if self._share and row >= 0:
            self._row_slots[row] = slot
        if self.xor and kind != "none" and not tensor.is_meta:
            self._checksums.append((slot, xor_words(tensor)))
        if copied:
            copy = self.stats.copy(tensor)
            self._items.append((slot, copy))
            self._item_bytes += copy.numel() * copy.element_size()
        return slot

    def _describe(self, value: Any, name: str) -> Any:
        return describe(value, name, self._leaf)

    def _grad_slots(self, grads: list, name: str) -> list:
        return [None if g is None else self._slot(g, f"{name}.{i}") for i, g in enumerate(grads)]

    def _emit(self) -> None:
        if self._items:
            items, self._items, self._item_bytes = self._items, [], 0
            self.emit_tensors(items)

    def _add_entry(self, name: str, entry: dict, parent: str | None, frames: StackNode | None) -> None:
        self.entries[name] = entry
        if self.sel.modules:
            self.construct[name] = parent
        if frames is not None and self.stacks is not None:
            self.stacks[name] = frames
        if self._item_bytes >= TENSOR_BATCH_BYTES or len(self._items) >= TENSOR_BATCH_COUNT:
            self._emit()

    def _count(self, key: str) -> int:
        n = self._counters.get(key, 0)
        self._counters[key] = n + 1
        return n

    def _outer(self) -> Want | None:
        """The decision of the innermost expanded module call running now, if any."""
        return next((c.want for c in reversed(self._modules) if c.want.expand), None)

    def _begin(self, module: Any, key: str, forward: str, backward: str) -> _Call:
        want = self.sel.want(key, forward, backward, self._outer())
        in_scope = self.sel.begin(forward)
        parent = self._modules[-1].forward if self._modules else None
        call = _Call(module, key, forward, backward, want, want.forward and in_scope, parent)
        if call.keep and self.config.stack:
            call.frames = self._stacks.stack()
        return call

    # ---- modules (L0, mix) -------------------------------------------------------------
    def module_begin(self, key: str, module: Any, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of a module named `key` (``Module.<path>.<Class>``)."""
        if not self.active or in_backward():
            return
        with self._hook("forward pre-hook of", key):
            n = self._count(key)
            call = self._begin(module, key, f"{key}.forward.{n}", f"{key}.backward.{n}")
            self._ran[key] = self._outer()
            if call.keep and self.sel.inputs:
                call.inputs = (self._describe(list(args), f"{call.forward}.input"),
                               self._describe(kwargs, f"{call.forward}.input"))
            if call.want.backward:
                call.edges = before_call(_tensors(args))
            self._modules.append(call)
            if self._eager:
                self.stats.flush()  # no API mode sees the call body's in-place writes

    def module_end(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        """Forward hook of a module (also called when its forward raised: output None)."""
        if not self._modules or self._modules[-1].module is not module:
            return
        with self._hook("forward hook"):
            call = self._modules.pop()
            params = dict(module.named_parameters(recurse=False)) if self.sel.inputs else None
            self._call_done(call, output, params)
            if self._eager:
                self.stats.flush()

    def param_grad(self, key: str, name: str, grad: torch.Tensor) -> None:
        """Gradient hook of parameter `name` of module `key`."""
        if key not in self._ran:
            return  # the module did not run while collecting in this step
        with self._hook("gradient hook of", key):
            entry_name = self._param_grad_name(key, name)
            want = self.sel.want(key, entry_name, entry_name, self._ran[key])
            if want.backward and self.sel.outputs and self.sel.begin(entry_name):
                grads = self.entries.setdefault(entry_name, {}).setdefault(name, [])
                suffix = f".{len(grads)}" if grads else ""
                grads.append(self._slot(grad, f"{entry_name}.{name}{suffix}"))
            self._flush_after_backward()

    def _param_grad_name(self, key: str, param: str) -> str:
        """``<key>.parameters_grad.<n>``: n counts the module's gradient passes (it grows when
        its first parameter's gradient arrives again), as the predecessor names them;
        ``<key>.parameters_grad`` in its 1.x format."""
        if self.config.predecessor_format == "1.x":
            return f"{key}.parameters_grad"
        index = self._grad_index.get(key)
        if index is None:
            index = self._grad_index[key] = [0, param]
        elif index[1] == param:
            index[0] += 1
        return f"{key}.parameters_grad.{index[0]}"

    # ---- APIs (L1, mix) ----------------------------------------------------------------
    def api_call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """The API mode's handler: record the call if it is dumped, run it, return its result.

        Before a call that writes into its arguments, waiting tensors that share their storage
        are protected (`StatBuffer.protect`); the call's own inputs are recorded first."""
        info = self.catalog.get(func)
        operator = self.operators.take() if self.operators is not None else None
        if operator is not None and (info is None or info.prefix == "Tensor"):
            info = self.catalog.operators[operator]  # ``x == y`` arrives as an object of its own
        writes = info.writes(args, kwargs) if info is not None else writes_unknown(func, kwargs)
        if info is None or not self.sel.apis or not self._records(info) or not self.active or in_backward():
            # in-place ops bump the version (the cache sees it); collectives do not
            if writes and (self.stats.pending or self._grad_calls or (info is not None and info.prefix == "Distributed")):
                with self._hook("in-place check of", getattr(func, "__name__", "")):
                    written = written_tensors(info, args, kwargs)
                    self.stats.protect(written)
                    self._rewrites.written(written)
            return func(*args, **kwargs)
        call = None
        with self._hook("API", info.key):
            n = self._count(info.key)
            call = self._begin(None, info.key, f"{info.key}.{n}.forward", f"{info.key}.{n}.backward")
            if call.keep and self.sel.inputs:
                called = as_called(info.code, args, kwargs) if info.code is not None else None
                if called is None:
                    called = list(args), info.user_kwargs(kwargs)
                call.inputs = (self._describe(called[0], f"{call.forward}.input"),
                               self._describe(called[1], f"{call.forward}.input"))
            if writes:
                written = written_tensors(info, args, kwargs)
                self.stats.protect(written)
                call.onto_output = self._rewrites.written(written)
        start = sequence_nr() if call is not None and call.want.backward else None
        output = func(*args, **kwargs)
        if call is not None:
            with self._hook("API", info.key):
                self._call_done(call, output)
                if call.want.backward and info.prefix != "Distributed":
                    self._watch_api_backward(call, output, start)
        return output

    def _records(self, info: ApiInfo) -> bool:
        """Whether calls of this API are recorded (with no ``list`` or ``scope``: by ``risk_level``,
        as the predecessor decides); answered once per API."""
        known = self._recorded.get(id(info))
        if known is not None and known[0] is info:
            return known[1]
        selected = bool(self.config.api_list) or self.config.scope is not None
        recorded = info.dump and (selected or risk_allows(self.config.risk_level, info))
        self._recorded[id(info)] = (info, recorded)
        return recorded

    def _call_done(self, call: _Call, output: Any, params: dict[str, Any] | None = None) -> None:
        """Close a module or API call: its forward entry, then its backward watch."""
        self.sel.end(call.forward)
        if call.keep:
            entry: dict[str, Any] = {}
            if call.inputs is not None:
                entry["input_args"], entry["input_kwargs"] = call.inputs
            if self.sel.outputs:
                entry["output"] = self._describe(_as_list(output), f"{call.forward}.output")
            if params is not None:
                entry["parameters"] = {k: self._slot(p, f"{call.forward}.parameters.{k}")
                                       for k, p in params.items()}
            self._add_entry(call.forward, entry, call.parent, call.frames)
        if call.edges is not None:
            self._watch_backward(call, _tensors(output))

    # ---- backward ----------------------------------------------------------------------
    def _watch_backward(self, call: _Call, outputs: list[torch.Tensor]) -> None:
        grad_call = after_call(call.edges, outputs, (self._step_id, call), self._backward_done)
        call.edges = None  # the input nodes are not needed any more
        if grad_call is not None:
            self._grad_calls.append(grad_call)
            if self._eager:
                grad_call.note_versions(outputs)
            else:
                self._rewrites.watch(outputs, grad_call)

    def _backward_done(self, grad_call: GradCall) -> None:
        step_id, call = grad_call.tag
        if step_id != self._step_id:
            return  # a graph kept from an earlier step
        with self._hook("backward of", call.key):
            self._grad_calls.remove(grad_call)
            if self._eager:
                grad_call.check_versions()
            arrived = any(g is not None for g in grad_call.output_grads + grad_call.input_grads)
            in_scope = self.sel.begin(call.backward)
            self.sel.end(call.backward)
            if arrived and call.want.backward and in_scope and not grad_call.rewritten:
                entry: dict[str, Any] = {}
                if self.sel.inputs:
                    entry["input"] = self._grad_slots(grad_call.output_grads, f"{call.backward}.input")
                if self.sel.outputs:  # no input needs a gradient: [] (as torch's module backward hooks give)
                    sent = grad_call.sent_grads()
                    grads = sent if any(g is not None for g in sent) else []
                    entry["output"] = self._grad_slots(grads, f"{call.backward}.output")
                self._add_entry(call.backward, entry, _backward_name(call.parent), None)
            self._flush_after_backward()

    def _watch_api_backward(self, call: _Call, output: Any, start: int | None) -> None:
        """An API's backward as the predecessor records it: the gradients in and out of the
        autograd node that made its (first) output; none when the call made no node (it returned
        its input: ``F.dropout(x, 0.0)``, ``x.contiguous()``; `start`: the sequence number before it)."""
        first = _first_tensor(output)
        if first is None or not first.requires_grad or first.grad_fn is None or not torch.is_grad_enabled():
            return
        if start is not None and first.grad_fn._sequence_nr() < start:
            return
        tag = (self._step_id, call)
        self._api_hooks.append(first.grad_fn.register_hook(partial(self._api_backward_done, tag)))

    def _api_backward_done(self, tag: tuple, grad_inputs: tuple, grad_outputs: tuple) -> None:
        step_id, call = tag
        if step_id != self._step_id or call.backward in self.entries:
            return  # a graph kept from an earlier step, or a second backward through it
        with self._hook("backward of", call.key):
            in_scope = self.sel.begin(call.backward)
            self.sel.end(call.backward)
            if in_scope:
                entry: dict[str, Any] = {}
                if self.sel.inputs:
                    entry["input"] = self._grad_slots(list(grad_outputs), f"{call.backward}.input")
                if self.sel.outputs:
                    # ``h = block(x); h += r``: the predecessor's module hook returns h as a view, so
                    # the in-place call's node is the view's, with one gradient (h's, unchanged)
                    sent = grad_outputs[:1] if call.onto_output else grad_inputs
                    entry["output"] = self._grad_slots(list(sent), f"{call.backward}.output")
                self._add_entry(call.backward, entry, _backward_name(call.parent), None)
            self._flush_after_backward()

    def _flush_after_backward(self) -> None:
        """Reduce the backward pass's tensors in one batch when the pass ends."""
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._flush_task:
            self._flush_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        with self._hook("end of backward"):
            self._flush_task = None
            self.stats.flush()


def tensor_crc32(tensor: torch.Tensor) -> str:
    """The predecessor's "md5" value: CRC-32 of the tensor's bytes (bfloat16 as float32), 8 hex digits."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return array_crc32(tensor.numpy())
