"""The online checker (``msprobe-engine run_ut --online``): receives API calls from training
processes, runs the float64 benchmark of each and writes the same report as the offline run.

One thread accepts connections, one thread per connection reads frames into a bounded queue
(when it is full, reading waits, TCP pushes back, and the sender's own bounded queue drops and
counts: the training is never held), and the main thread checks the queued calls in order. A
sender that dies mid-stream ends only its own connection. SIGTERM or SIGINT stops accepting;
each connection is read on until it is quiet (at most `DRAIN_S` seconds), and everything read
is checked before the report is closed.
"""
from __future__ import annotations

import errno
import logging
import queue
import signal
import socket
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from msprobe_engine.analysis.precheck.protocol import (CASE, END, HELLO, ProtocolError, parse_hello, read_frame,
                                                       server_tls)
from msprobe_engine.analysis.precheck.report import PrecheckReport
from msprobe_engine.analysis.precheck.runner import PrecheckConfig, check_case
from msprobe_engine.analysis.precheck.transport import CASE_SUFFIX, END_SUFFIX
from msprobe_engine.registry import load_framework

log = logging.getLogger("msprobe_engine")
_STOP = object()
ACCEPT_POLL_S = 0.2
#: after stop, a connection still sending is read for at most this long (then cut between frames)
DRAIN_S = 10.0


class CheckerServer:
    """Listens on `config.host:config.port` (port 0: a free one, see `port`), or with
    `config.nfs_path` watches that directory (`transport.DirectoryTransport`'s files); see the
    module docstring."""

    def __init__(self, out_dir: Path | str, config: PrecheckConfig, *, queue_size: int = 256, device: str = "cpu",
                 resume: bool = False) -> None:
        self.config, self.device = config, device
        self.received = self.lost_connections = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._stopping = threading.Event()
        self._deadline = float("inf")
        self._lock = threading.Lock()  # the counters, from the connection threads
        if config.nfs_path:
            self.directory: Path | None = Path(config.nfs_path)
            if not self.directory.is_dir():
                raise RuntimeError(f"nfs_path {self.directory}: no such directory (create it, shared with the "
                                   f"training nodes)")
            self.port = None
            self._feeder = threading.Thread(target=self._watch, name="msprobe-precheck-watch", daemon=True)
        else:
            self.directory = None
            self._tls = server_tls(config.tls_path)
            self._listener = _listen(config.host, config.port)
            self.port = self._listener.getsockname()[1]
            self._feeder = threading.Thread(target=self._accept, name="msprobe-precheck-accept", daemon=True)
        self.report = PrecheckReport(out_dir, resume=resume, precision=config.precision)

    @property
    def where(self) -> str:
        return f"watching {self.directory}" if self.directory else f"listening on {self.config.host}:{self.port}"

    def serve(self) -> None:
        """Check calls until `stop()`; then check what was received and close the report."""
        self._feeder.start()
        precheck: dict[str, Any] = {}
        while (item := self._queue.get()) is not _STOP:
            framework, payload, done = item
            try:
                fw = precheck.get(framework) or precheck.setdefault(framework, load_framework(framework).precheck())
                case = fw.decode_case(payload)
            except Exception as e:  # a payload this checker cannot read: reported, the others go on
                log.error("msprobe run_ut online: cannot decode an API call: %s: %s", type(e).__name__, e)
            else:
                self.report.add(check_case(case, fw, self.device, recorded_output=True))
            if done is not None:
                done()
        self.report.close()

    def stop(self) -> None:
        """Stop accepting and reading; `serve` returns once the received calls are checked."""
        if self._stopping.is_set():
            return
        self._deadline = time.monotonic() + DRAIN_S
        self._stopping.set()
        threading.Thread(target=self._finish, daemon=True).start()

    def _finish(self) -> None:
        self._feeder.join()
        for reader in [t for t in threading.enumerate() if t.name.startswith("msprobe-precheck-conn")]:
            reader.join()
        self._queue.put(_STOP)

    def _end_stream(self, idle: bool) -> bool:
        """Between two frames of a connection: stop reading it? (stopping, and it is quiet or
        the drain time is over)."""
        return self._stopping.is_set() and (idle or time.monotonic() > self._deadline)

    def _accept(self) -> None:
        """Accept until stopped; then the connections still waiting in the backlog (their
        senders already count their calls as sent), then close the listener."""
        while True:
            stopping = self._stopping.is_set()
            if stopping:
                self._listener.setblocking(False)
            try:
                conn, peer = self._listener.accept()
            except (TimeoutError, BlockingIOError):
                if stopping:
                    break
                continue
            except OSError:
                break
            conn.settimeout(ACCEPT_POLL_S)
            if self._tls is not None:
                try:
                    conn = self._tls.wrap_socket(conn, server_side=True)
                except OSError as e:
                    log.warning("msprobe run_ut online: TLS handshake with %s failed: %s", peer, e)
                    conn.close()
                    continue
            threading.Thread(target=self._read, args=(conn, peer), name=f"msprobe-precheck-conn-{peer[1]}",
                             daemon=True).start()
        self._listener.close()

    def _read(self, conn: socket.socket, peer: Any) -> None:
        framework, ended = None, False
        try:
            while (frame := read_frame(conn, self._end_stream)) is not None:
                kind, payload = frame
                if kind == HELLO:
                    info = parse_hello(payload)
                    framework = info["framework"]
                    log.info("msprobe run_ut online: %s connected (pid %s, rank %s)", peer, info.get("pid"),
                             info.get("rank"))
                elif kind == CASE:
                    if framework is None:
                        raise ProtocolError("a case frame before the hello frame")
                    self._queue.put((framework, payload, None))
                    with self._lock:
                        self.received += 1
                elif kind == END:
                    ended = True
                    break
        except (ProtocolError, OSError) as e:
            if not self._stopping.is_set():
                log.warning("msprobe run_ut online: connection from %s lost: %s", peer, e)
        finally:
            conn.close()
        if not (ended or self._stopping.is_set()):
            with self._lock:
                self.lost_connections += 1
            log.warning("msprobe run_ut online: %s went away without closing (training killed?); "
                        "the checker goes on", peer)


    def _watch(self) -> None:
        """Queue the case files of the directory as they appear (each deleted once checked);
        after `stop`, one last look."""
        queued: set[Path] = set()
        while True:
            stopping = self._stopping.is_set()
            for file in sorted(self.directory.glob(f"*{CASE_SUFFIX}")):
                if file in queued:
                    continue
                try:
                    payload = file.read_bytes()
                except FileNotFoundError:  # checked and removed since the listing
                    continue
                except OSError as e:
                    log.warning("msprobe run_ut online: cannot read %s: %s", file, e)
                    continue
                queued.add(file)
                with self._lock:
                    self.received += 1
                self._queue.put((file.name.split(".", 1)[0], payload, partial(_remove, file, queued)))
            for end in self.directory.glob(f"*{END_SUFFIX}"):
                log.info("msprobe run_ut online: sender %s closed", end.stem)
                _remove(end)
            if stopping:
                return
            time.sleep(ACCEPT_POLL_S)


def _remove(file: Path, queued: set[Path] | None = None) -> None:
    try:
        file.unlink()
    except OSError as e:
        log.warning("msprobe run_ut online: cannot remove %s: %s", file, e)
    if queued is not None:
        queued.discard(file)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket whose accept() times out (close() does not wake a blocked accept())."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        why = "the port is in use (another checker?)" if e.errno == errno.EADDRINUSE else e.strerror
        raise RuntimeError(f"cannot listen on {host}:{port}: {why}; choose another --port") from None
    listener.listen()
    listener.settimeout(ACCEPT_POLL_S)
    return listener


def serve(out_dir: Path | str, config: PrecheckConfig, *, queue_size: int = 256, device: str = "cpu",
          resume: bool = False) -> int:
    """The ``run_ut --online`` verb: serve until SIGTERM/SIGINT; prints the address, then the counts."""
    server = CheckerServer(out_dir, config, queue_size=queue_size, device=device, resume=resume)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    print(f"run_ut --online: {server.where}; results: {server.report.result_path}", flush=True)
    server.serve()
    counts = ", ".join(f"{n} {status}" for status, n in sorted(server.report.counts.items()))
    print(f"run_ut --online: {server.received} call(s) received, {counts or 'none checked'}; "
          f"{server.lost_connections} connection(s) lost", flush=True)
    return 0
