"""Wrap a public method on one object (never on its class), removably."""
from __future__ import annotations

from typing import Any, Callable


class MethodWrap:
    """`obj.name` replaced by a wrapper that returns `after(result)` (or `after_call(args, kwargs,
    result)`) once the original returned `result`, or calls `on_error(args, kwargs)` before an
    exception propagates. `remove()`
    makes the wrapper call nothing but the original, and restores the previous attribute
    while the wrapper is still in place (a later wrapper from another tool keeps working)."""

    def __init__(self, obj: Any, name: str, after: Callable[[Any], Any] | None = None,
                 on_error: Callable[[tuple, dict], None] | None = None,
                 after_call: Callable[[tuple, dict, Any], Any] | None = None) -> None:
        original = getattr(obj, name)
        self._obj, self._name, self._live = obj, name, True
        self._previous = obj.__dict__.get(name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                result = original(*args, **kwargs)
            except Exception:
                if self._live and on_error is not None:
                    on_error(args, kwargs)
                raise
            if self._live and after is not None:
                return after(result)
            if self._live and after_call is not None:
                return after_call(args, kwargs, result)
            return result

        self._wrapper = wrapper
        setattr(obj, name, wrapper)

    def remove(self) -> None:
        self._live = False
        if self._obj.__dict__.get(self._name) is self._wrapper:
            if self._previous is None:
                delattr(self._obj, self._name)
            else:
                setattr(self._obj, self._name, self._previous)
