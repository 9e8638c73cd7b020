"""The one background writer thread: every file the tool writes is written here.

Jobs (plain callables) wait in a bounded queue. When it is full the policy
is either `drop` (the job is dropped and counted) or `wait` (the training
thread blocks until there is room). A job that raises is reported once per
job kind and the writer goes on; in strict mode the first error is re-raised
on the training thread at the next `flush()`/`close()`.

Failures are counted per sink (a job kind `"<name> sink <what>"` counts under `<name>`):
`health()` gives them as metrics for the step records, and `close()` logs a summary.
Threads a sink's library starts (such as tensorboard's own event writer, should a sink use
it; the TensorBoard sink writes its file on this thread, `tb_records`) print no raw traceback
when they die on a full disk: `contain_thread_errors` logs one line instead (the error
itself reaches the sink's next call, where it is counted).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("msprobe_engine")

_STOP = object()
#: modules whose threads die with one logged line instead of a traceback
CONTAINED_THREAD_MODULES = ("tensorboard.",)


class BackgroundWriter:
    def __init__(self, queue_size: int = 256, when_full: str = "drop", strict: bool = False) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._wait = when_full == "wait"
        self._strict = strict
        self.dropped = 0
        self.failed = 0
        #: failed jobs per sink (or per job kind outside a sink), and the last error of each
        self.failures: dict[str, int] = {}
        self.last_error: dict[str, str] = {}
        self._reported: set[str] = set()
        self._error: BaseException | None = None
        contain_thread_errors()
        self._thread = threading.Thread(target=self._run, name="msprobe-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], kind: str = "job", wait: bool | None = None) -> bool:
        """Queue `job`; return False if it was dropped because the queue is full (`wait`: wait
        for room whatever the policy, e.g. for the jobs that close the files)."""
        try:
            self._queue.put((job, kind), block=self._wait if wait is None else wait)
            return True
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("msprobe writer queue is full: dropping %s (further drops are counted)", kind)
            return False

    def health(self) -> dict[str, float]:
        """`writer/<sink>/failed` and `writer/dropped` counts so far, only those above zero."""
        out = {f"writer/{name}/failed": float(count) for name, count in self.failures.items()}
        if self.dropped:
            out["writer/dropped"] = float(self.dropped)
        return out

    def summary(self) -> str:
        """One line on what could not be written (empty when everything was)."""
        parts = [f"{name}: {count} failed ({self.last_error[name]})" for name, count in self.failures.items()]
        if self.dropped:
            parts.append(f"{self.dropped} dropped (queue full)")
        return "; ".join(parts)

    def flush(self) -> None:
        """Block until every queued job has run; raise the first error in strict mode."""
        self._queue.join()
        self._raise_if_strict()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put((_STOP, "stop"))
            self._thread.join()
        summary = self.summary()
        if summary:
            log.warning("msprobe writer: not everything was written: %s", summary)
        self._raise_if_strict()

    def _raise_if_strict(self) -> None:
        if self._strict and self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            job, kind = self._queue.get()
            try:
                if job is _STOP:
                    return
                job()
            except Exception as exc:  # reported, never kills training
                self.failed += 1
                owner = kind.partition(" sink ")[0]
                self.failures[owner] = self.failures.get(owner, 0) + 1
                self.last_error[owner] = f"{type(exc).__name__}: {exc}"[:200]
                self._error = self._error or exc
                if kind not in self._reported:
                    self._reported.add(kind)
                    log.error("msprobe writer: %s failed: %s: %s (further failures are counted)",
                              kind, type(exc).__name__, exc)
            finally:
                self._queue.task_done()


_previous_hook = None


def contain_thread_errors() -> None:
    """Install (once) a `threading.excepthook` that turns the death of a thread started by a
    sink's library (`CONTAINED_THREAD_MODULES`) into one logged line; other threads keep the
    hook they had."""
    global _previous_hook
    if _previous_hook is not None:
        return
    _previous_hook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__module__.startswith(CONTAINED_THREAD_MODULES) and args.exc_type is not SystemExit:
            log.error("msprobe writer: %s thread stopped: %s: %s", type(args.thread).__name__,
                      args.exc_type.__name__, args.exc_value)
            return
        _previous_hook(args)

    threading.excepthook = hook
