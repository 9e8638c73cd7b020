"""The call stack of each recorded call (stack.json), walked only as far as it changed.

Consecutive recorded calls mostly come from the same frames (the optimizer's loop over its
parameters, a module's forward): a frame still running at the same line as at the last walk
has the same callers, as they all wait for it. So the walk stops at the first such frame and
the new `StackNode`s hang under its chain. That holds for plain functions only: a generator or
coroutine frame may have been resumed from elsewhere since, so it never ends a walk.

A frame's position is read as its bytecode offset (``f_lasti``): its line (``f_lineno``) costs
a scan of the function's line table, tens of microseconds in a long function such as torch's
optimizers' loops, so lines are looked up only for the frames a stack lists, once per (code,
offset), from a cache kept across steps.

This package's own frames (the hooks and the API mode between the caller and `stack`) are
skipped as the walk meets them: they are never listed, so they are neither held nor looked up.
The frames of the last walk are held (strong references, to recognise them) until the next
walk or `clear`; every other frame is released as usual.
"""
from __future__ import annotations

import inspect
import os
import sys
from typing import Any

from msprobe_engine.dump.writer import StackNode

#: frames of this directory (msprobe_engine/frameworks/torch) are left out of the stacks
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: code flags of frames that can be suspended and resumed by another caller
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


#: most (code, offset) -> line pairs cached (a run making code objects endlessly starts anew)
MAX_LINES = 1 << 16


class CallStacks:
    """`stack()`: the caller's stack, innermost first, without this package's frames."""

    def __init__(self) -> None:
        #: (id(code), offset) -> (code, its line there): the code is held, so its id stays its own
        self._lines: dict[tuple[int, int], tuple[Any, int]] = {}
        self.clear()

    def clear(self) -> None:
        """Release the frames of the last walk (at the step's end)."""
        #: id(frame) -> (frame, its line then, the chain from it up, its depth from the outermost)
        self._known: dict[int, tuple[Any, int, StackNode | None, int]] = {}
        #: ids of the last walk's frames, outermost first
        self._chain: list[int] = []

    def stack(self) -> StackNode | None:
        known, chain = self._known, self._chain
        walked = []
        node, depth = None, 0
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(PACKAGE_DIR):  # never listed, never a known frame
                frame = frame.f_back
                continue
            offset = frame.f_lasti
            seen = known.get(id(frame))
            if seen is not None and seen[0] is frame and seen[1] == offset and not code.co_flags & _RESUMABLE:
                node, depth = seen[2], seen[3] + 1
                break
            walked.append((frame, code, offset))
            frame = frame.f_back
        for stale in chain[depth:]:
            del known[stale]
        del chain[depth:]
        for frame, code, offset in reversed(walked):
            node = StackNode((code.co_filename, self._line(frame, code, offset), code.co_name), node)
            known[id(frame)] = (frame, offset, node, len(chain))
            chain.append(id(frame))
        return node

    def _line(self, frame: Any, code: Any, offset: int) -> int:
        """The line `frame` (running `code`) is at, bytecode `offset`."""
        cached = self._lines.get((id(code), offset))
        if cached is not None and cached[0] is code:
            return cached[1]
        if len(self._lines) >= MAX_LINES:
            self._lines.clear()
        line = frame.f_lineno
        self._lines[(id(code), offset)] = (code, line)
        return line
