"""What writes in the background is closed when the process ends without `close()`.

The predecessor has no ``close()``: a run ends after its last ``step()``, and a monitored run
may end the same way. So every guarded owner of a `sinks.BackgroundWriter` (a dump session:
its open step committed; a `Monitor`: its held records emitted, its sinks closed) is closed,
its writer drained and its thread joined, by one `atexit` handler: on a normal end, and when
an exception leaves the program. Python 3.11 joins non-daemon threads before atexit handlers
run and stops daemon threads (the writer is one) only after them, so the writer is still
alive there and its last ``torch.save`` or record write ends before the interpreter goes down.

SIGTERM (what a scheduler sends) and SIGINT, where their handler is the default action, get
a handler that only raises `SystemExit` in the main thread (no I/O in the handler's frame);
the same atexit handler then writes the dump and delivers the signal again with its default
action, so the process still ends by that signal. SIGINT under Python's own handler gets one
that raises KeyboardInterrupt as Python's does. Where the program installed a handler of its
own before the session started, that handler runs unchanged (a handler that exits the process
reaches the atexit handler too).

The exception a signal raises lands between two bytecodes of whatever the main thread runs; in
the middle of a step's end it could drop the step's record on its way from the step's held
tables to the writer's queue. So the owners' step-boundary code runs as a `critical` section:
a signal arriving inside one raises its exception when the section ends (a second signal
meanwhile at once, should the section hang).

A main thread blocked in a C call (a collective that never returns) runs no Python handler:
there the scheduler's SIGKILL ends it, and every step committed before stays valid.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import weakref
from typing import Any

log = logging.getLogger("msprobe_engine")

#: the signals whose default action ends the process without atexit handlers
SIGNALS = (signal.SIGTERM, signal.SIGINT)

#: guarded owner -> the name of its method that closes it at exit
_owners: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_installed = False
#: signal -> the handler ours replaced (SIG_DFL, or Python's `default_int_handler` for SIGINT)
_replaced: dict[int, Any] = {}
#: the signal that is ending the process (delivered again after the sessions are closed)
_ending: int | None = None
#: `critical` sections open on the main thread, and a signal that arrived inside one
_depth = 0
_deferred: int | None = None
_MAIN = threading.main_thread().ident


def guard(owner: Any, closer: str = "close") -> None:
    """Call ``owner.<closer>()`` when the process ends (unless `owner` was collected before);
    installs the handlers once. Owners are closed in the order they were guarded."""
    global _installed
    _owners[owner] = closer
    if _installed:
        return
    _installed = True
    atexit.register(close_all)
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            current = signal.getsignal(signum)
            if current is signal.SIG_DFL or (signum == signal.SIGINT and current is signal.default_int_handler):
                _replaced[signum] = current
                signal.signal(signum, _on_signal)


class critical:
    """``with critical():`` a stretch of the main thread that SIGTERM/SIGINT must not cut in two
    (see the module docstring); elsewhere it does nothing."""

    __slots__ = ("_counted",)

    def __enter__(self) -> None:
        global _depth
        self._counted = threading.get_ident() == _MAIN
        if self._counted:
            _depth += 1

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        global _depth, _deferred, _ending
        if not self._counted:
            return
        _depth -= 1
        if _depth == 0 and _deferred is not None:
            signum, _deferred = _deferred, None
            if exc_type is None:
                _raise_for(signum)
            elif _replaced.get(signum) is not signal.default_int_handler:
                _ending = signum  # the exception leaving the section ends the run; the signal then ends the process


def _on_signal(signum: int, frame: Any) -> None:
    """Unwind the main thread, or note the signal for the end of a `critical` section."""
    global _deferred
    if _depth and _deferred is None:
        _deferred = signum
        return
    _raise_for(signum)


def _raise_for(signum: int) -> None:
    """The exception the signal's replaced handler stood for: KeyboardInterrupt for Python's own
    SIGINT handler; else SystemExit, `close_all` then writing what is left and ending the process
    by `signum`."""
    global _ending
    if _replaced.get(signum) is signal.default_int_handler:
        raise KeyboardInterrupt
    _ending = signum
    raise SystemExit(128 + signum)


def close_all() -> None:
    """Close every guarded owner (the atexit handler); then deliver a pending signal again. A
    second signal while they write takes the default action at once."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, _replaced.get(signum, signal.SIG_DFL))
    for owner, closer in list(_owners.items()):
        try:
            getattr(owner, closer)()
        except Exception:
            log.exception("msprobe: closing %s at exit failed", type(owner).__name__)
    if _ending is not None:
        signum = _ending
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
