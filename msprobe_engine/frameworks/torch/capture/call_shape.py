"""The arguments of a Python API as its caller wrote them.

A Python torch function (``F.layer_norm``, ``F.embedding``) reaches the API mode through
``handle_torch_function`` with its arguments re-passed: ``layer_norm(x, [16], weight=w,
bias=b, eps=1e-05)`` however it was called. The predecessor wraps the function and records
what the caller passed (``nn.LayerNorm`` passes all five positionally). To record the same,
the caller's frame is found (the frame above the function's own) and its call instruction
read: how many arguments it passes and which by keyword. The decoded shape is cached per
(code object, instruction offset), so a call site is decoded once.
"""
from __future__ import annotations

import dis
import sys
from types import CodeType, FrameType
from typing import Any

#: frames walked up from the API mode to the function's own frame
MAX_FRAMES = 8
_VARARGS = 0x04 | 0x08  # CO_VARARGS | CO_VARKEYWORDS

Shape = tuple[int, tuple[str, ...]]
_shapes: dict[tuple[CodeType, int], Shape | None] = {}


def _decode(code: CodeType, offset: int) -> Shape | None:
    """(positional count, keyword names) of the call at `offset`, or None (``f(*a, **k)``...)."""
    instructions = list(dis.get_instructions(code))
    # the frame's offset may point past the instruction, into its inline caches
    at = next((i for i in range(len(instructions) - 1, -1, -1) if instructions[i].offset <= offset), None)
    if at is None or instructions[at].opname not in ("CALL", "CALL_KW"):
        return None
    argc = instructions[at].arg or 0
    names: tuple[str, ...] = ()
    back = at - 1
    while back >= 0 and instructions[back].opname in ("PRECALL", "CACHE"):
        back -= 1
    if back >= 0 and instructions[back].opname in ("KW_NAMES", "LOAD_CONST") and (
            instructions[at].opname == "CALL_KW" or instructions[back].opname == "KW_NAMES"):
        value = instructions[back].argval
        names = value if isinstance(value, tuple) else code.co_consts[instructions[back].arg]
    if len(names) > argc:
        return None
    return argc - len(names), tuple(names)


def _running(func_code: CodeType, start: FrameType | None) -> FrameType | None:
    """The frame of the running call of the function with code `func_code`, going up from `start`."""
    frame, hops = start, 0
    while frame is not None and frame.f_code is not func_code and hops < MAX_FRAMES:
        frame, hops = frame.f_back, hops + 1
    return frame if frame is not None and frame.f_code is func_code else None


def call_shape(func_code: CodeType, start: FrameType | None) -> Shape | None:
    """How the running call of the function with code `func_code` was written by its caller."""
    frame = _running(func_code, start)
    caller = frame.f_back if frame is not None else None
    if caller is None:
        return None
    key = (caller.f_code, caller.f_lasti)
    if key not in _shapes:
        _shapes[key] = _decode(*key)
    return _shapes[key]


def as_called(func_code: CodeType, args: tuple, kwargs: dict) -> tuple[list, dict] | None:
    """``(args, kwargs)`` of a Python function's running call (called from within it, through
    its torch-function handling) as its caller wrote them, or None when that cannot be told
    (arguments passed with ``*``/``**``, a function taking some of them so). A function taking
    only ``(*args, **kwargs)`` (``F.max_pool2d``'s boolean dispatch) has them as passed."""
    if func_code.co_flags & _VARARGS == _VARARGS and func_code.co_argcount + func_code.co_kwonlyargcount == 0:
        frame = _running(func_code, sys._getframe(1))
        if frame is None:
            return None
        passed = frame.f_locals
        names = func_code.co_varnames
        return list(passed[names[0]]), dict(passed[names[1]])
    if func_code.co_flags & _VARARGS:
        return None
    shape = call_shape(func_code, sys._getframe(1))
    if shape is None:
        return None
    positional, keywords = shape
    names = func_code.co_varnames[:func_code.co_argcount + func_code.co_kwonlyargcount]
    bound: dict[str, Any] = dict(zip(names, args))
    bound.update(kwargs)
    if positional > func_code.co_argcount or any(n not in bound for n in names[:positional]) \
            or any(k not in bound for k in keywords):
        return None
    return [bound[n] for n in names[:positional]], {k: bound[k] for k in keywords}
