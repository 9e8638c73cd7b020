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

#: guarded owner -> the name of its method that closes it at exit
_owners: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_installed = False
#: the signal that is ending the process (delivered again after the sessions are closed)
_ending: int | None = None


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
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _on_signal)


def _on_signal(signum: int, frame: Any) -> None:
    """Unwind the main thread; `close_all` writes what is left and ends the process by `signum`."""
    global _ending
    _ending = signum
    raise SystemExit(128 + signum)


def close_all() -> None:
    """Close every guarded owner (the atexit handler); then deliver a pending signal again. A
    second signal while they write takes the default action at once."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, signal.SIG_DFL)
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
