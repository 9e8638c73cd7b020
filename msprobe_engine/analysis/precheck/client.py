"""The training side's connection to the online checker: a bounded queue and one sender thread.

`submit` never blocks the training thread: when the queue is full (the checker falls behind) or
the checker cannot be reached, the call is dropped and counted. The thread connects, encodes
each queued item (the framework's encoder, off the training thread) and sends it; `close`
sends what is queued, then the end frame. A checker that is absent or goes away is reported
once (a warning naming the address) and the training goes on unchecked.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
from typing import Any, Callable

from msprobe_engine.analysis.precheck.protocol import CASE, END, HELLO, client_tls, hello, write_frame

log = logging.getLogger("msprobe_engine")
_CLOSE = object()
#: after the end frame, how long to wait for the checker to close its side
CLOSE_WAIT_S = 10.0


def _wait_for_close(sock: socket.socket) -> None:
    """Half-close and read until the checker closes: a socket closed with bytes still unread
    (TLS session tickets) is reset, and a reset can discard frames the checker has not read yet."""
    sock.settimeout(CLOSE_WAIT_S)
    sock.shutdown(socket.SHUT_WR)
    while sock.recv(1 << 16):
        pass


class CheckerClient:
    """Sends encoded items to the checker at `host:port` (see the module docstring)."""

    def __init__(self, host: str, port: int, framework: str, encode: Callable[[Any], bytes], *,
                 rank: int | None = None, queue_size: int = 64, connect_timeout: float = 5.0,
                 tls_ca: str | None = None) -> None:
        self.address = (host, port)
        self.sent = self.dropped = 0
        self.error: str | None = None
        self._encode, self._framework, self._rank = encode, framework, rank
        self._timeout, self._tls = connect_timeout, client_tls(tls_ca)
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
        """Send what is queued and the end frame, then stop the thread (waits at most `timeout` s)."""
        try:
            self._queue.put(_CLOSE, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self.dropped:
            log.warning("msprobe run_ut online: %d API call(s) not checked (checker queue full or unreachable)",
                        self.dropped)

    def _connect(self) -> socket.socket:
        host, _ = self.address
        sock = socket.create_connection(self.address, timeout=self._timeout)
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_hostname=host)
        sock.settimeout(None)
        write_frame(sock, HELLO, hello(self._framework, self._rank))
        log.info("msprobe run_ut online: sending API calls to the checker at %s:%d", *self.address)
        return sock

    def _fail(self, what: str, exc: BaseException) -> None:
        host, port = self.address
        self.error = f"{what} the checker at {host}:{port}: {type(exc).__name__}: {exc}"
        log.warning("msprobe run_ut online: %s; API calls are not checked from here on (is "
                    "`msprobe-engine run_ut --online --port %d` running?)", self.error, port)

    def _run(self) -> None:
        try:
            sock = self._connect()
        except (OSError, ValueError) as e:
            self._fail("cannot reach", e)
            self._drain()
            return
        with sock:
            while (item := self._queue.get()) is not _CLOSE:
                try:
                    payload = self._encode(item)
                except Exception as e:  # an item the encoder cannot take: reported once, the rest goes on
                    self.dropped += 1
                    log.warning("msprobe run_ut online: cannot encode an API call: %s: %s", type(e).__name__, e)
                    continue
                try:
                    write_frame(sock, CASE, payload)
                    self.sent += 1
                except OSError as e:
                    self.dropped += 1
                    self._fail("lost the connection to", e)
                    self._drain()
                    return
            try:
                write_frame(sock, END, b"")
                _wait_for_close(sock)
            except OSError:
                pass

    def _drain(self) -> None:
        """After a failure: count what is queued as dropped until close."""
        while self._queue.get() is not _CLOSE:
            self.dropped += 1
