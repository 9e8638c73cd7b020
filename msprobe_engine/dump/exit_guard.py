"""Dump sessions closed when the process ends without `close()`.

The predecessor has no ``close()``: a run ends after its last ``step()``. So every open
session is closed (its open step committed, the writer drained, its thread joined) by an
`atexit` handler: on a normal end, and when an exception leaves the program. Python 3.11
joins non-daemon threads before atexit handlers run and stops daemon threads (the writer is
one) only after them, so the writer is still alive there and its last ``torch.save`` ends
before the interpreter goes down.

SIGTERM (what a scheduler sends) and SIGINT, where their handler is the default action, get
a handler that only raises `SystemExit` in the main thread (no I/O in the handler's frame);
the same atexit handler then writes the dump and delivers the signal again with its default
action, so the process still ends by that signal. Where the program installed its own
handler before the session started, that handler runs unchanged (Python's SIGINT handler
raises KeyboardInterrupt; a handler that exits the process reaches the atexit handler too).
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

_sessions: "weakref.WeakSet[Any]" = weakref.WeakSet()
_installed = False
#: the signal that is ending the process (delivered again after the sessions are closed)
_ending: int | None = None


def guard(session: Any) -> None:
    """Close `session` (its ``close()``) when the process ends; installs the handlers once."""
    global _installed
    _sessions.add(session)
    if _installed:
        return
    _installed = True
    atexit.register(close_all)
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _on_signal)


def _on_signal(signum: int, frame: Any) -> None:
    """Unwind the main thread; `close_all` writes the dump and ends the process by `signum`."""
    global _ending
    _ending = signum
    raise SystemExit(128 + signum)


def close_all() -> None:
    """Close every open session (the atexit handler); then deliver a pending signal again. A
    second signal while the dump is written takes the default action at once."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, signal.SIG_DFL)
    for session in list(_sessions):
        try:
            session.close()
        except Exception:
            log.exception("msprobe dump: closing the dump session at exit failed")
    if _ending is not None:
        signum = _ending
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
