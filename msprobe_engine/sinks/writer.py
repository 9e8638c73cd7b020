"""The one background writer thread: every file the tool writes is written here.

Jobs (plain callables) wait in a bounded queue. When it is full the policy
is either `drop` (the job is dropped and counted) or `wait` (the training
thread blocks until there is room). A job that raises is reported once per
job kind and the writer goes on; in strict mode the first error is re-raised
on the training thread at the next `flush()`/`close()`.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("msprobe_engine")

_STOP = object()


class BackgroundWriter:
    def __init__(self, queue_size: int = 256, when_full: str = "drop", strict: bool = False) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._wait = when_full == "wait"
        self._strict = strict
        self.dropped = 0
        self.failed = 0
        self._reported: set[str] = set()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="msprobe-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], kind: str = "job") -> bool:
        """Queue `job`; return False if it was dropped because the queue is full."""
        try:
            self._queue.put((job, kind), block=self._wait)
            return True
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("msprobe writer queue is full: dropping %s (further drops are counted)", kind)
            return False

    def flush(self) -> None:
        """Block until every queued job has run; raise the first error in strict mode."""
        self._queue.join()
        self._raise_if_strict()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put((_STOP, "stop"))
            self._thread.join()
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
                self._error = self._error or exc
                if kind not in self._reported:
                    self._reported.add(kind)
                    log.error("msprobe writer: %s failed: %s: %s", kind, type(exc).__name__, exc)
            finally:
                self._queue.task_done()
