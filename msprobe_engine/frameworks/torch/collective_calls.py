"""The training's own ``torch.distributed`` collectives, seen as they are called: op kind and bytes.

While anything listens (`listen`), the collective functions of the ``torch.distributed`` module
are replaced by wrappers that tell every listener ``(kind, nbytes)`` and call the original; with
no listener left the originals are put back (a wrapper someone kept meanwhile only calls through).
`nbytes` is what this rank hands to the collective, from the tensors' sizes (no host sync): the
tensor of an all-reduce, broadcast, reduce, send or gather; the input of an all-gather,
reduce-scatter or all-to-all (each list summed); what it receives for recv and scatter; 0 for a
barrier. Not seen: calls made by the monitor itself (a caller in `msprobe_engine` or
`msprobe_integrations`: its statistics merge, its decisions), collectives issued from C++ (DDP's
gradient buckets), functional collectives (``torch.distributed._functional_collectives``, DTensor),
object collectives, lone ``isend``/``irecv`` (``P2POp`` accepts only the originals; the ops of
``batch_isend_irecv`` are counted), and functions imported by name before the wrappers went in.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

#: the op kinds counted, in the order of their rows
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter",
         "send", "recv", "barrier")
#: torch.distributed function -> (kind, the parameter holding what this rank sends; None: nothing)
FUNCTIONS: dict[str, tuple[str, str | None]] = {
    "all_reduce": ("all_reduce", "tensor"), "broadcast": ("broadcast", "tensor"), "reduce": ("reduce", "tensor"),
    "all_gather": ("all_gather", "tensor"), "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "all_gather_single": ("all_gather", "input_tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list"), "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"), "all_to_all_single": ("all_to_all", "input"),
    "gather": ("gather", "tensor"), "scatter": ("scatter", "tensor"),
    "send": ("send", "tensor"), "recv": ("recv", "tensor"),
    "barrier": ("barrier", None), "monitored_barrier": ("barrier", None),
}
#: callers whose collectives are the monitor's own
OWN_PACKAGES = ("msprobe_engine.", "msprobe_integrations.")

Listener = Callable[[str, int], None]
_listeners: list[Listener] = []
_originals: dict[str, Callable[..., Any]] = {}


class Listening:
    """A listener's registration; `remove()` ends it (the last one puts the originals back)."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener

    def remove(self) -> None:
        if self.listener in _listeners:
            _listeners.remove(self.listener)
            if not _listeners:
                _restore()
        self.listener = None  # type: ignore[assignment]


def listen(listener: Listener) -> Listening:
    """Call `listener(kind, nbytes)` at each collective the training issues, until `remove()`."""
    if not _listeners:
        _install()
    _listeners.append(listener)
    return Listening(listener)


def nbytes(value: Any) -> int:
    """The bytes of a tensor, or of the tensors of a list (anything else: 0)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


def _tell(kind: str, size: int) -> None:
    if sys._getframe(2).f_globals.get("__name__", "").startswith(OWN_PACKAGES):
        return
    for listener in list(_listeners):
        listener(kind, size)


def _counted(fn: Callable[..., Any], kind: str, param: str | None) -> Callable[..., Any]:
    names = list(inspect.signature(fn).parameters)
    at = names.index(param) if param is not None else -1

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if _listeners:
            sent = (args[at] if at < len(args) else kwargs.get(param)) if at >= 0 else None
            _tell(kind, nbytes(sent))
        return fn(*args, **kwargs)
    return counted


def _batch_counted(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def counted(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
        if _listeners:
            for p2p in p2p_op_list:
                _tell("send" if getattr(p2p.op, "__name__", "") == "isend" else "recv", nbytes(p2p.tensor))
        return fn(p2p_op_list, *args, **kwargs)
    return counted


def _install() -> None:
    for name, (kind, param) in FUNCTIONS.items():
        fn = getattr(dist, name, None)
        if fn is not None:
            _originals[name] = fn
            setattr(dist, name, _counted(fn, kind, param))
    if hasattr(dist, "batch_isend_irecv"):
        _originals["batch_isend_irecv"] = dist.batch_isend_irecv
        dist.batch_isend_irecv = _batch_counted(dist.batch_isend_irecv)


def _restore() -> None:
    for name, fn in _originals.items():
        if getattr(getattr(dist, name, None), "__wrapped__", None) is fn:
            setattr(dist, name, fn)
    _originals.clear()
