"""How encoded calls travel from the training to the checker: a TCP connection (optionally TLS),
or a shared directory (the predecessor's ``nfs_path``), for nodes that share storage but
cannot open a port to each other.

Directory layout: each call is one file ``<framework>.<pid>.<seq>.case`` (written under a
``.partial`` name, then renamed, so the checker never reads half a file); a sender that closes
cleanly leaves ``<framework>.<pid>.end``. The checker deletes each case file once its rows are
written, so a checker that is stopped or killed leaves the unchecked calls where they are.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

from msprobe_engine.analysis.precheck.protocol import CASE, END, HELLO, client_tls, hello, write_frame

#: after the end frame, how long to wait for the checker to close its side
CLOSE_WAIT_S = 10.0
CASE_SUFFIX, END_SUFFIX, PARTIAL_SUFFIX = ".case", ".end", ".partial"


class Backlogged(Exception):
    """The checker has more waiting than the sender may add (the call is dropped and counted)."""


class TcpTransport:
    """One connection to the checker at `host:port`."""

    def __init__(self, host: str, port: int, tls_ca: str | None = None, connect_timeout: float = 5.0) -> None:
        self.host, self.port, self._timeout = host, port, connect_timeout
        self._tls = client_tls(tls_ca)
        self._sock: socket.socket | None = None

    @property
    def where(self) -> str:
        return f"the checker at {self.host}:{self.port}"

    @property
    def hint(self) -> str:
        return f"is `msprobe-engine run_ut --online --port {self.port}` running?"

    def open(self, framework: str, rank: int | None) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=self._timeout)
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_hostname=self.host)
        sock.settimeout(None)
        write_frame(sock, HELLO, hello(framework, rank))
        self._sock = sock

    def send(self, payload: bytes) -> None:
        write_frame(self._sock, CASE, payload)

    def close(self) -> None:
        """The end frame; then half-close and read until the checker closes: a socket closed with
        bytes still unread (TLS session tickets) is reset, and a reset can discard frames the
        checker has not read yet."""
        with self._sock as sock:
            write_frame(sock, END, b"")
            sock.settimeout(CLOSE_WAIT_S)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):
                pass


class DirectoryTransport:
    """Case files in a directory shared with the checker; at most `max_pending` files waiting."""

    def __init__(self, path: str | Path, max_pending: int = 256) -> None:
        self.path, self.max_pending = Path(path), max_pending
        self._stem, self._seq = "", 0

    @property
    def where(self) -> str:
        return f"the checker directory {self.path}"

    @property
    def hint(self) -> str:
        return f"does {self.path} exist, and is `msprobe-engine run_ut --online --nfs-path {self.path}` running?"

    def open(self, framework: str, rank: int | None) -> None:
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no such directory")
        if not os.access(self.path, os.W_OK):
            raise PermissionError(f"{self.path}: not writable")
        self._stem = f"{framework}.{os.getpid()}"

    def send(self, payload: bytes) -> None:
        if sum(1 for _ in self.path.glob(f"*{CASE_SUFFIX}")) >= self.max_pending:
            raise Backlogged(f"{self.max_pending} calls already wait in {self.path}")
        name = f"{self._stem}.{self._seq:09d}{CASE_SUFFIX}"
        self._seq += 1
        partial = self.path / (name + PARTIAL_SUFFIX)
        partial.write_bytes(payload)
        os.replace(partial, self.path / name)

    def close(self) -> None:
        (self.path / f"{self._stem}{END_SUFFIX}").touch()
