"""API-level (L1, mix) interception for MindSpore in PyNative mode: every API call through a Cell.

MindSpore 2.10 has no dispatch hook in Python (nothing like torch's ``TorchFunctionMode``);
what it offers publicly for watching a call are Cell hooks (forward pre-hook, forward hook,
backward hook). So each dumped API gets one `ApiCell` whose ``construct`` calls the API,
with the dump's hooks on it, and the public name is rebound, for the duration of the
session, to a small function that routes the call through that Cell while recording
(`Gate.open`) and calls the API directly otherwise:

- ``mindspore.ops.<f>`` as ``Functional.<f>``, ``mindspore.mint.<f>`` as ``Mint.<f>``,
  ``mindspore.mint.nn.functional.<f>`` as ``MintFunctional.<f>``,
  ``mindspore.communication.comm_func.<f>`` as ``Distributed.<f>``,
  ``mindspore.mint.distributed.<f>`` as ``MintDistributed.<f>`` (module attributes);
- ``Tensor.<method>`` (and the arithmetic, comparison and indexing operators) as ``Tensor.<m>``;
- Primitive instances held by the net's Cells (``nn.Dense`` calls ``self.matmul``, a
  ``MatMul`` primitive) as ``Primitive.<attribute>.<Class>``: while a step is dumped, the
  instance's class is swapped for a subclass whose ``__call__`` routes the call (MindSpore
  still sees a Primitive); between dumped steps it has its own class back.

The names are the predecessor's. A call made inside a recorded call (an API calling another)
is not recorded again. Code that imported a function object before the session started
(``from mindspore.ops import relu``) calls the original and is not seen. Inside a compiled
graph (``mindspore.jit``, GRAPH_MODE) the route compiles to the plain call (hooks do not run),
so nothing there is dumped, and nothing there breaks.
"""
from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

from mindspore import Tensor, mint, nn, ops
from mindspore.ops.primitive import Primitive

from msprobe_engine.frameworks.mindspore.cell_hooks import jit_safe

#: Tensor operators that compute (the rest: repr, hash, pickling, conversions to Python)
TENSOR_OPERATORS = frozenset(
    f"__{op}__" for base in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow")
    for op in (base, f"r{base}", f"i{base}")) | frozenset(
    f"__{op}__" for op in ("and", "or", "xor", "getitem", "setitem", "neg", "pos", "abs", "invert",
                           "eq", "ne", "lt", "le", "gt", "ge"))
#: Primitive classes that read metadata or only order the graph: not dumped
METADATA_PRIMITIVES = frozenset(("Shape", "TensorShape", "DType", "Rank", "Size", "Depend", "HookBackward",
                                 "CellBackwardHook"))
#: metadata, conversion, storage, hook and autodiff routines: not dumped
NOT_DUMPED = frozenset((
    # Tensor
    "asnumpy", "numpy", "tolist", "item", "itemset", "data_sync", "data_ptr", "dim", "ndimension", "numel",
    "nelement", "stride", "storage", "storage_offset", "untyped_storage", "is_contiguous", "is_complex",
    "is_floating_point", "is_init", "is_pinned", "is_shared", "is_signed", "init_data", "register_hook",
    "remove_hook", "hooks", "requires_grad_", "set_cast_dtype", "set_const_arg", "set_device_address",
    "set_dtype", "set_init_flag", "set_param_info", "setitem_index_info", "getitem_index_info", "get_bytes",
    "convert_bytes_to_tensor", "from_numpy", "from_dlpack", "to_dlpack", "flush_from_cache", "offload",
    "offload_file_path", "move_to", "pin_memory", "wait_pipeline", "assign_value", "assign_value_cpp", "value",
    "type", "index", "contiguous",
    # mindspore.ops / mint
    "grad", "value_and_grad", "vmap", "jvp", "vjp", "jacfwd", "jacrev", "derivative", "stop_gradient", "depend",
    "constexpr", "primitive", "prim_attr_register", "custom_info_register", "op_info_register", "print_",
    "shape", "dtype", "rank", "size", "is_tensor", "tensor_dump", "deprecated", "jit_class", "typename",
    "is_available", "is_initialized", "init_process_group", "destroy_process_group", "new_group", "get_rank",
    "get_world_size", "get_backend", "get_global_rank", "get_group_rank", "get_process_group_ranks",
    "get_cache_group_rank", "get_cache_group_size", "get_group_rank_from_world_rank", "get_group_size",
))


_INHERITED = object()  # a Tensor method defined on its C++ base class: removed again, not set back


@dataclass(frozen=True, slots=True)
class ApiName:
    """Where a dumped API lives and the prefix of its entries."""
    owner: Any          # the module or class holding it
    attribute: str      # its name there
    key: str            # ``Functional.relu``, ``Tensor.__add__``


def _dumped(name: str) -> bool:
    if name.startswith("__"):
        return name in TENSOR_OPERATORS
    return not name.startswith(("_", "is_")) and name not in NOT_DUMPED


def _namespaces() -> list[tuple[str, Any]]:
    from mindspore.communication import comm_func
    from mindspore.mint import distributed
    from mindspore.mint.nn import functional

    return [("Functional", ops), ("Mint", mint), ("MintFunctional", functional), ("Distributed", comm_func),
            ("MintDistributed", distributed)]


def api_names() -> list[ApiName]:
    """Every API this dump records: the public functions of the namespaces and Tensor's methods."""
    found = [ApiName(module, name, f"{prefix}.{name}") for prefix, module in _namespaces()
             for name, value in sorted(vars(module).items()) if inspect.isfunction(value) and _dumped(name)]
    found += [ApiName(Tensor, name, f"Tensor.{name}") for name in sorted(dir(Tensor))
              if _dumped(name) and inspect.isroutine(getattr(Tensor, name, None))]
    return found


def api_keys() -> frozenset[str]:
    """``<Prefix>.<name>`` of every API this dump records (for checking ``list``/``scope`` names)."""
    return frozenset(name.key for name in api_names())


def missing_interfaces() -> list[str]:
    """The MindSpore interfaces this interception needs and the installed MindSpore lacks."""
    import mindspore

    missing = [f"mindspore.{name}" for name in ("mint", "mint.nn.functional", "mint.distributed",
                                                "communication.comm_func")
               if importlib.util.find_spec(f"mindspore.{name}") is None]
    if "with_kwargs" not in inspect.signature(nn.Cell.register_forward_hook).parameters:
        missing.append("mindspore.nn.Cell.register_forward_hook(..., with_kwargs=True)")
    if not hasattr(nn.Cell, "register_backward_hook"):
        missing.append("mindspore.nn.Cell.register_backward_hook")
    return [f"{name} (MindSpore {mindspore.__version__})" for name in missing]


class Gate:
    """Whether calls are routed through their Cells now (recording, and not inside the dump's own work)."""
    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = False


class ApiCell(nn.Cell):
    """One API as a Cell: ``construct`` calls it, the dump's hooks sit on the Cell."""

    def __init__(self, func: Callable[..., Any]) -> None:
        super().__init__(auto_prefix=False)
        self.func = func

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)


def _routed_function(gate: Gate, func: Callable[..., Any], cell: ApiCell) -> Callable[..., Any]:
    """What the public name holds during the session (graph-compilable: no try, no with)."""
    def routed(*args: Any, **kwargs: Any) -> Any:
        if gate.open:
            return cell(*args, **kwargs)
        return func(*args, **kwargs)

    routed.__name__, routed.__qualname__, routed.__doc__ = func.__name__, func.__qualname__, func.__doc__
    routed.__wrapped__ = func
    return routed


def _routed_primitive(gate: Gate, base: type, cells: dict[int, ApiCell]) -> type:
    """A subclass of a Primitive class whose calls go through the instance's Cell while recording."""
    def __call__(self: Primitive, *args: Any) -> Any:
        if gate.open:
            return cells[id(self)](*args)
        return base.__call__(self, *args)

    return type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})


def cell_primitives(net: nn.Cell) -> Iterator[tuple[str, Primitive]]:
    """(``Primitive.<attribute>.<Class>``, instance) for the public Primitive attributes of every Cell
    of `net` that compute (not `Shape`, `DType`..., nor MindSpore's own hook primitives)."""
    seen: set[int] = set()
    for _, cell in net.cells_and_names():
        for attribute, value in vars(cell).items():
            if (isinstance(value, Primitive) and id(value) not in seen and not attribute.startswith("_")
                    and type(value).__name__ not in METADATA_PRIMITIVES):
                seen.add(id(value))
                yield f"Primitive.{attribute}.{type(value).__name__}", value


class ApiHooks:
    """The interception of one session: installed at construction, undone by `remove()`."""

    def __init__(self, recorder: Any, gate: Gate, backward: bool) -> None:
        self.recorder, self.gate, self.backward = recorder, gate, backward
        self._restore: list[tuple[Any, str, Any]] = []
        self._classes: list[tuple[Primitive, type, type]] = []  # (instance, its class, routed subclass)
        self._cells: dict[int, ApiCell] = {}
        for name in api_names():
            func = getattr(name.owner, name.attribute)
            self._restore.append((name.owner, name.attribute, vars(name.owner).get(name.attribute, _INHERITED)))
            setattr(name.owner, name.attribute, _routed_function(gate, func, self._cell(name.key, func)))

    def hook_primitives(self, net: nn.Cell) -> None:
        """Prepare the routes of the Primitives held by `net`'s Cells (taken by `route_primitives`)."""
        routed: dict[type, type] = {}
        for key, prim in cell_primitives(net):
            base = type(prim)
            if base not in routed:
                routed[base] = _routed_primitive(self.gate, base, self._cells)
            self._cells[id(prim)] = self._cell(key, partial(base.__call__, prim))
            self._classes.append((prim, base, routed[base]))

    def route_primitives(self, on: bool) -> None:
        """Swap the Primitives' classes for their routed subclasses (`on`) or back: only while a
        step is dumped, so that between dumped steps the net's Primitives are exactly as built."""
        for prim, base, routed in self._classes:
            prim.__class__ = routed if on else base

    def _cell(self, key: str, func: Callable[..., Any]) -> ApiCell:
        """The API's Cell with the recorder's hooks: ``api_begin(key)``, ``api_end(key, args, kwargs,
        output, func)`` (with ``recorder.replaces_outputs``, a value it returns replaces the output:
        free_benchmark's fix mode) and,
        when asked, ``api_backward(key, grad_input, grad_output)``."""
        cell = ApiCell(func)
        recorder = self.recorder
        cell.register_forward_pre_hook(jit_safe(lambda _cell, _args: recorder.api_begin(key)))
        def end(_cell: ApiCell, args: tuple, kwargs: dict, output: Any) -> Any:
            return recorder.api_end(key, args, kwargs, output, func)

        # a recorder that replaces outputs needs the hook's value (PyNative only: its session refuses GRAPH_MODE)
        cell.register_forward_hook(end if getattr(recorder, "replaces_outputs", False) else jit_safe(end),
                                   with_kwargs=True)
        if self.backward:
            cell.register_backward_hook(jit_safe(lambda _cell, grad_input, grad_output:
                                                 recorder.api_backward(key, grad_input, grad_output)))
        return cell

    def remove(self) -> None:
        """Give every name and Primitive its original back."""
        for owner, attribute, original in reversed(self._restore):
            if original is _INHERITED:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
        self.route_primitives(False)
        self._restore.clear()
        self._classes.clear()
        self._cells.clear()
