"""API-level (L1) interception through a TorchFunctionMode: no torch function object is replaced.

Every call of a torch function, Tensor method, torch.nn.functional function or
torch.distributed collective that goes through ``__torch_function__`` reaches the mode with
the function object itself, so ``from torch import relu; relu(x)`` is seen like
``torch.relu(x)``, and ``F.gelu is F.gelu`` stays true for code that type-checks it (the
predecessor's FAQ items 3 and 11). While the mode runs a call it is off the mode stack, so
calls made inside an API (``F.multi_head_attention_forward`` -> ``linear``...) are not seen
again: one entry per API call, as the predecessor records.

`ApiCatalog` names the function objects (``Functional.relu``, ``Tensor.add``,
``Torch.linalg.norm``, ``Distributed.all_reduce``) and knows which ones write into their
arguments (in-place), which the dump needs to measure inputs before they change.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

#: torch namespaces dumped as ``Torch.<namespace>.<name>``
TORCH_SUBMODULES = ("linalg", "fft", "special")
#: collectives that go through __torch_function__; two are renamed to their public names
DISTRIBUTED = ("send", "recv", "isend", "irecv", "broadcast", "all_reduce", "all_reduce_coalesced", "reduce",
               "all_gather", "all_gather_single", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
               "reduce_scatter_single", "all_to_all_single", "all_to_all")
DISTRIBUTED_NAMES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
#: Tensor operators recorded under their dunder name (``x + y``: ``Tensor.__add__``), as the
#: predecessor records them; the call arrives as the method (``add``), `OperatorNames` tells which
OPERATORS = (
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__div__", "__rdiv__", "__idiv__", "__truediv__", "__floordiv__", "__ifloordiv__", "__mod__", "__rmod__",
    "__imod__", "__pow__", "__rpow__", "__ipow__", "__matmul__", "__and__", "__iand__", "__or__", "__ror__",
    "__ior__", "__xor__", "__rxor__", "__ixor__", "__lshift__", "__ilshift__", "__rshift__", "__irshift__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__")
#: operators told apart but not recorded, as the predecessor does not record them: ``-x``
#: (``Tensor.neg`` is ``__neg__``; ``x.neg()`` is recorded) and ``x /= y`` (it arrives as ``div_``)
UNRECORDED_OPERATORS = ("__neg__", "__itruediv__")
#: Tensor dunders that are dumped: the operators and item assignment (the others: repr, hash,
#: len, pickling, indexing and conversions are not, as in the predecessor)
TENSOR_DUNDERS = frozenset(OPERATORS) | {"__setitem__"}
INPLACE_DUNDERS = frozenset(d for d in (*OPERATORS, *UNRECORDED_OPERATORS) if d.startswith("__i")) | {"__setitem__"}
#: arguments an API writes into besides its first (BatchNorm's running statistics, updated in
#: training): (position, keyword) by API key; they are measured before the call
ARGUMENT_WRITES: dict[str, tuple[tuple[int, str], ...]] = {
    "Functional.batch_norm": ((1, "running_mean"), (2, "running_var")),
    "Functional.instance_norm": ((1, "running_mean"), (2, "running_var")),
}
#: the predecessor's low-risk APIs (shape and view changes, casts, tensor creation): skipped at
#: ``risk_level`` FOCUS (its default), recorded at ALL
LOW_RISK = frozenset((
    "squeeze", "unsqueeze", "reshape", "reshape_as", "view", "view_as", "flatten", "unflatten", "expand",
    "expand_as", "repeat", "repeat_interleave", "tile", "transpose", "permute", "moveaxis", "movedim",
    "swapaxes", "swapdims", "chunk", "unsafe_chunk", "split", "split_with_sizes", "unsafe_split",
    "unsafe_split_with_sizes", "tensor_split", "hsplit", "vsplit", "dsplit", "unbind", "stack", "cat", "concat",
    "concatenate", "hstack", "vstack", "dstack", "column_stack", "row_stack", "atleast_1d", "atleast_2d",
    "atleast_3d", "ravel", "clamp", "unfold", "type_as", "to", "float", "double", "int", "long", "half",
    "bfloat16", "byte", "char", "bool", "cfloat", "empty", "empty_like", "zeros", "zeros_like", "ones",
    "ones_like", "full", "full_like", "arange", "linspace", "logspace", "eye", "diag", "diagflat",
    "diag_embed", "triu", "tril", "triu_indices", "tril_indices", "clone", "tensor", "as_tensor", "asarray",
    "from_numpy", "contiguous", "detach", "new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided",
    "new_tensor"))
#: the predecessor's core APIs: the only ones recorded at ``risk_level`` CORE
CORE_RISK = frozenset((
    "matmul", "__matmul__", "bmm", "addmm", "addmm_", "addbmm", "addbmm_", "baddbmm", "baddbmm_", "mm", "mv",
    "addmv", "addmv_", "addr", "addr_", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "conv_tbc", "convolution", "_convolution", "linear", "bilinear", "linalg.matmul",
    "linalg.multi_dot", "linalg.vecdot", "batch_norm", "instance_norm", "layer_norm", "group_norm",
    "local_response_norm", "_batch_norm_impl_index", "embedding", "embedding_bag",
    "multi_head_attention_forward", "scaled_dot_product_attention"))


def risk_allows(level: str, info: "ApiInfo") -> bool:
    """Whether an API is recorded at the predecessor's ``risk_level`` (CORE, FOCUS, ALL);
    collectives count as core."""
    if level == "ALL":
        return True
    if info.prefix == "Distributed" or info.name in CORE_RISK:
        return True
    return level == "FOCUS" and info.name not in LOW_RISK


#: private torch functions the predecessor dumps (called directly by torch.nn.utils and some models)
PRIVATE_DUMPED = frozenset(("_adaptive_avg_pool2d", "_add_relu", "_add_relu_", "_aminmax", "_batch_norm_impl_index",
                            "_convolution", "_foreach_norm", "_softmax_backward_data"))
#: metadata, autograd and Python-conversion calls: not dumped
NOT_DUMPED = frozenset((
    "size", "dim", "ndimension", "stride", "numel", "nelement", "element_size", "storage_offset", "data_ptr",
    "get_device", "untyped_storage", "storage", "storage_type", "has_names", "dim_order", "tolist", "item",
    "numpy", "backward", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "requires_grad_",
    "share_memory_", "result_type", "can_cast", "promote_types", "typename", "save", "load", "compile",
    "broadcast_shapes", "manual_seed", "seed", "initial_seed", "vmap", "cond", "while_loop",
    "handle_torch_function", "has_torch_function", "has_torch_function_unary", "has_torch_function_variadic",
    "boolean_dispatch", "assert_int_or_pair",
))


@dataclass(frozen=True, slots=True)
class ApiInfo:
    """How the dump names and treats one function object."""
    prefix: str                 # Torch | Tensor | Functional | Distributed
    name: str                   # relu, linalg.norm, all_reduce
    dump: bool                  # dumped at L1/mix (False: only watched for in-place writes)
    inplace: bool               # writes into an argument (add_, __setitem__, collectives)
    inplace_arg: int | None = None  # position of an ``inplace`` parameter (F.relu(x, inplace))
    defaults: dict[str, Any] | None = None  # parameter defaults of a Python function
    code: CodeType | None = None  # the code of a Python function (its arguments are re-read, `as_called`)
    key: str = field(init=False)  # <prefix>.<name>, as in the dump's entry names (read on every call)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.prefix}.{self.name}")

    def user_kwargs(self, kwargs: dict) -> dict:
        """`kwargs` without the parameters a Python API re-passes at their default value
        (``F.relu(x)`` reaches the mode as ``relu(x, inplace=False)``; the user wrote no kwargs)."""
        if not self.defaults or not kwargs:
            return kwargs
        return {k: v for k, v in kwargs.items() if k not in self.defaults or not _same(v, self.defaults[k])}

    def writes(self, args: tuple, kwargs: dict) -> bool:
        """True when this call writes into one of its arguments."""
        if self.inplace or "out" in kwargs or self.key in ARGUMENT_WRITES:
            return True
        if self.inplace_arg is None:
            return False
        if "inplace" in kwargs:
            return bool(kwargs["inplace"])
        return len(args) > self.inplace_arg and bool(args[self.inplace_arg])


def _inplace_name(name: str) -> bool:
    return name in INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def _dumped_name(name: str) -> bool:
    """Whether an API of this (possibly dotted: ``linalg.cond``) name is dumped."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.startswith("__"):
        return leaf in TENSOR_DUNDERS
    if leaf.startswith("_"):
        return name in PRIVATE_DUMPED
    return not leaf.startswith("is_") and name not in NOT_DUMPED


def _preference(name: str) -> tuple[bool, bool]:
    """Scan order within a namespace: public names, then private ones, then dunders."""
    return name.startswith("__"), name.startswith("_")


def _defaults(func: Callable) -> dict[str, Any] | None:
    """Parameter defaults of a Python function (through decorators)."""
    func = inspect.unwrap(func)
    code, values = getattr(func, "__code__", None), getattr(func, "__defaults__", None) or ()
    if code is None:
        return None
    names = code.co_varnames[code.co_argcount - len(values):code.co_argcount]
    return {**dict(zip(names, values)), **(getattr(func, "__kwdefaults__", None) or {})} or None


def _code(func: Callable) -> CodeType | None:
    return getattr(inspect.unwrap(func), "__code__", None)


def _same(value: Any, default: Any) -> bool:
    if value is default:
        return True
    plain = (bool, int, float, str)
    return type(value) in plain and type(value) is type(default) and value == default


def _inplace_position(func: Callable) -> int | None:
    code = getattr(func, "__code__", None)
    if code is None or "inplace" not in code.co_varnames[:code.co_argcount]:
        return None
    return code.co_varnames.index("inplace")


class ApiCatalog:
    """Function object -> `ApiInfo`, built once from the torch namespaces."""

    def __init__(self) -> None:
        self._infos: dict[int, tuple[Any, ApiInfo]] = {}
        self._keys: frozenset[str] | None = None
        #: the operator forms of Tensor methods (``Tensor.__add__``), see `operators`
        self.operators = {name: ApiInfo("Tensor", name, dump=name in OPERATORS, inplace=name in INPLACE_DUNDERS)
                          for name in (*OPERATORS, *UNRECORDED_OPERATORS)}
        # first prefix wins: F.conv2d is torch.conv2d, and is named Functional.conv2d
        self._scan("Functional", vars(torch.nn.functional).items())
        self._scan("Tensor", ((n, getattr(torch.Tensor, n, None)) for n in dir(torch.Tensor)))
        self._scan("Torch", vars(torch).items())
        for sub in TORCH_SUBMODULES:
            module = getattr(torch, sub, None)
            if module is not None:
                self._scan("Torch", ((f"{sub}.{n}", v) for n, v in vars(module).items() if not n.startswith("_")))
        if torch.distributed.is_available():
            import torch.distributed as dist
            for name in DISTRIBUTED:
                if hasattr(dist, name):
                    func = getattr(dist, name)
                    self._add(func, ApiInfo("Distributed", DISTRIBUTED_NAMES.get(name, name), dump=True,
                                            inplace=True, defaults=_defaults(func), code=_code(func)))

    def _scan(self, prefix: str, items: Iterable[tuple[str, Any]]) -> None:
        """Name every routine of a namespace. An object with several names (Tensor.abs is
        Tensor.__abs__, torch.mm is torch.dsmm) takes its own ``__name__`` when that is one of
        them, else its first public one."""
        for name, obj in sorted(items, key=lambda item: _preference(item[0].rsplit(".", 1)[-1])):
            if not inspect.isroutine(obj):
                continue
            leaf = name.rsplit(".", 1)[-1]
            known = self.get(obj)
            if known is not None and not (known.prefix == prefix and not leaf.startswith("_")
                                          and getattr(obj, "__name__", None) == leaf):
                continue
            self._add(obj, ApiInfo(prefix, name, dump=_dumped_name(name), inplace=_inplace_name(leaf),
                                   inplace_arg=_inplace_position(obj), defaults=_defaults(obj), code=_code(obj)))

    def _add(self, obj: Any, info: ApiInfo) -> None:
        self._infos[id(obj)] = (obj, info)

    def get(self, func: Any) -> ApiInfo | None:
        """The info of a function object (by identity: distinct builtins may compare equal)."""
        known = self._infos.get(id(func))
        return known[1] if known is not None and known[0] is func else None

    def dumped(self) -> list[ApiInfo]:
        """Every API the dump records, one per name."""
        infos = [i for _, i in self._infos.values() if i.dump] + [i for i in self.operators.values() if i.dump]
        return sorted({i.key: i for i in infos}.values(), key=lambda i: i.key)

    def has_key(self, key: str) -> bool:
        """True when ``<Prefix>.<name>`` (``Functional.relu``) is a dumped API."""
        if self._keys is None:
            self._keys = frozenset(i.key for i in self.dumped())
        return key in self._keys


def writes_unknown(func: Any, kwargs: dict) -> bool:
    """In-place check of a function the catalog does not know (by its name; not cached)."""
    return "out" in kwargs or _inplace_name(getattr(func, "__name__", "") or "")


def written_tensors(info: ApiInfo | None, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a writing call writes into: its first argument (or the tensors in it),
    ``out`` and its `ARGUMENT_WRITES`; every tensor argument of a collective."""
    if info is not None and info.prefix == "Distributed":
        targets = list(args)
    else:
        targets = [] if info is not None and info.key in ARGUMENT_WRITES else list(args[:1])
    if "out" in kwargs:
        targets.append(kwargs["out"])
    for position, keyword in ARGUMENT_WRITES.get(info.key, ()) if info is not None else ():
        targets.append(args[position] if len(args) > position else kwargs.get(keyword))
    found: list[torch.Tensor] = []
    for target in targets:
        if isinstance(target, torch.Tensor):
            found.append(target)
        elif isinstance(target, (list, tuple)):
            found.extend(t for t in target if isinstance(t, torch.Tensor))
    return found


class ApiMode(TorchFunctionMode):
    """Hands every torch function call to `handler(func, args, kwargs)`; replaces nothing."""

    def __init__(self, handler: Callable[[Any, tuple, dict], Any]) -> None:
        super().__init__()
        self.handler = handler

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.handler(func, args, kwargs or {})


def push_mode(mode: TorchFunctionMode) -> None:
    """Put `mode` on this thread's torch-function mode stack."""
    torch._C._push_on_torch_function_stack(mode)


def remove_mode(mode: TorchFunctionMode) -> None:
    """Take `mode` off this thread's stack, even when modes entered later sit above it."""
    stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    if not any(m is mode for m in stack):
        return
    above = []
    while (top := torch._C._pop_torch_function_stack()) is not mode:
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
