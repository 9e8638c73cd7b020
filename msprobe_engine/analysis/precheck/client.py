"""The training side's link to the online checker: a bounded queue and one sender thread.

`submit` never blocks the training thread: when the queue is full (the checker falls behind) or
the checker cannot be reached, the call is dropped and counted. The thread opens the
transport (`transport.TcpTransport` or `transport.DirectoryTransport`), encodes each queued
item (the framework's encoder, off the training thread) and sends it; `close` sends what is
queued, then ends the stream. A checker that is absent or goes away is reported once (a
warning naming where it was expected) and the training goes on unchecked.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from msprobe_engine.analysis.precheck.transport import Backlogged, DirectoryTransport, TcpTransport

log = logging.getLogger("msprobe_engine")
_CLOSE = object()

Transport = TcpTransport | DirectoryTransport


class CheckerClient:
    """Sends encoded items through `transport` (see the module docstring)."""

    def __init__(self, transport: Transport, framework: str, encode: Callable[[Any], bytes], *,
                 rank: int | None = None, queue_size: int = 64) -> None:
        self.transport = transport
        self.sent = self.dropped = 0
        self.error: str | None = None
        self._encode, self._framework, self._rank = encode, framework, rank
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="msprobe-precheck-sender", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False once the checker proved unreachable (submissions are then dropped at once)."""
        return self.error is None

    def submit(self, item: Any) -> bool:
        """Queue one item; False (and counted in `dropped`) when it cannot be taken now."""
        if self.error is None:
            try:
                self._queue.put_nowait(item)
                return True
            except queue.Full:
                pass
        self.dropped += 1
        return False

    def close(self, timeout: float = 60.0) -> None:
        """Send what is queued and end the stream, then stop the thread (waits at most `timeout` s)."""
        try:
            self._queue.put(_CLOSE, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self.dropped:
            log.warning("msprobe run_ut online: %d API call(s) not checked (checker behind or unreachable)",
                        self.dropped)

    def _fail(self, what: str, exc: BaseException) -> None:
        self.error = f"{what} {self.transport.where}: {type(exc).__name__}: {exc}"
        log.warning("msprobe run_ut online: %s; API calls are not checked from here on (%s)", self.error,
                    self.transport.hint)

    def _run(self) -> None:
        try:
            self.transport.open(self._framework, self._rank)
        except (OSError, ValueError) as e:
            self._fail("cannot reach", e)
            self._drain()
            return
        log.info("msprobe run_ut online: sending API calls to %s", self.transport.where)
        while (item := self._queue.get()) is not _CLOSE:
            try:
                payload = self._encode(item)
            except Exception as e:  # an item the encoder cannot take: reported, the rest goes on
                self.dropped += 1
                log.warning("msprobe run_ut online: cannot encode an API call: %s: %s", type(e).__name__, e)
                continue
            try:
                self.transport.send(payload)
                self.sent += 1
            except Backlogged:
                self.dropped += 1
            except OSError as e:
                self.dropped += 1
                self._fail("lost", e)
                self._drain()
                return
        try:
            self.transport.close()
        except OSError:
            pass

    def _drain(self) -> None:
        """After a failure: count what is queued as dropped until close."""
        while self._queue.get() is not _CLOSE:
            self.dropped += 1
