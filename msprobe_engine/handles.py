"""Hook handles removed together: the one `remove()` of the objects that install hooks."""
from __future__ import annotations

from typing import Any, Iterable, Protocol


class Removable(Protocol):
    """Anything installed that can be taken out again (a hook handle, a wrapped method)."""

    def remove(self) -> None:
        """Take it out; a second call does nothing."""


class Handles:
    """Holds `handles` (objects with `remove()`); `remove()` removes them all, once. A class that
    installs hooks subclasses it and appends what it installed to `self.handles`."""

    handles: list[Any]

    def __init__(self, handles: Iterable[Removable] = ()) -> None:
        self.handles = list(handles)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
