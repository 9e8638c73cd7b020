"""Which Tensor operator a call comes from: ``x + y`` is recorded as ``Tensor.__add__``.

``x + y``, ``x.add(y)`` and ``2 + x`` all reach a TorchFunctionMode as ``Tensor.add``; the
predecessor records the operator forms under their dunder names (``__add__``, ``__radd__``,
``__iadd__``), and its counters count them apart. While a dumped step runs, each operator of
`api.OPERATORS` on ``torch.Tensor`` (and of `api.UNRECORDED_OPERATORS`, told apart to be left
out: ``-x``, ``x /= y``) is shadowed by a thin function that notes its name in a
thread-local and calls the original; the API mode takes the note for the call it sees next.
Outside dumped steps ``torch.Tensor`` is left exactly as it was.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from msprobe_engine.frameworks.torch.capture.api import OPERATORS, UNRECORDED_OPERATORS

_ABSENT = object()


def _original(name: str) -> Callable:
    """``torch.Tensor``'s operator `name`, under the notes another session may have installed."""
    found = getattr(torch.Tensor, name)
    while hasattr(found, "_msprobe_original"):
        found = found._msprobe_original
    return found


class OperatorNames:
    """Installs the operator notes on ``torch.Tensor`` (`install`/`remove`) and hands them out (`take`)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._saved: dict[str, Any] = {}
        self._wrappers = {name: self._wrap(name, _original(name)) for name in (*OPERATORS, *UNRECORDED_OPERATORS)
                          if hasattr(torch.Tensor, name)}

    def _wrap(self, name: str, original: Callable) -> Callable:
        local = self._local

        def operator(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(local, "name", None)
            local.name = name
            try:
                return original(*args, **kwargs)
            finally:
                local.name = outer
        operator.__name__ = operator.__qualname__ = name
        operator._msprobe_original = original  # type: ignore[attr-defined]
        return operator

    def install(self) -> None:
        if self._saved:
            return
        for name, wrapper in self._wrappers.items():
            self._saved[name] = torch.Tensor.__dict__.get(name, _ABSENT)
            setattr(torch.Tensor, name, wrapper)

    def remove(self) -> None:
        for name, original in self._saved.items():
            if original is _ABSENT:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._saved.clear()

    def take(self) -> str | None:
        """The operator the current call was written as (consumed), or None (a method call)."""
        name = getattr(self._local, "name", None)
        if name is not None:
            self._local.name = None
        return name
