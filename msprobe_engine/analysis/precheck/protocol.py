"""The online pre-check's wire format (TCP, optionally TLS): frames of ``kind (1 byte) | length
(8 bytes, big-endian) | payload``.

A connection starts with one ``H`` (hello) frame, a JSON object ``{"protocol": "msprobe-engine
precheck", "version": 1, "framework": "torch", "pid": ..., "rank": ...}``; then ``C`` (case)
frames, each one API call encoded by the framework (torch: ``torch.save`` of the call's
arguments and output, read back with ``weights_only=True``); then ``E`` (end) when the sender
closes cleanly. A connection that ends without ``E`` (the training process was killed) loses
only what was not yet received; the checker goes on serving the others.
"""
from __future__ import annotations

import json
import os
import socket
import ssl
import struct
from pathlib import Path
from typing import Any, Callable

PROTOCOL, VERSION = "msprobe-engine precheck", 1
HELLO, CASE, END = b"H", b"C", b"E"
_HEADER = struct.Struct("!cQ")
#: a frame larger than this is refused (a corrupt or foreign stream)
MAX_FRAME = 1 << 34


class ProtocolError(ConnectionError):
    """A stream that is not (or no longer) this protocol."""


def write_frame(sock: socket.socket, kind: bytes, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(kind, len(payload)) + payload)


def _read_exactly(sock: socket.socket, size: int, end: Callable[[bool], bool] | None = None) -> bytes | None:
    """`size` bytes; None when the peer closed (or `end(idle)` said so) before the first byte.
    A socket with a timeout is polled: between frames `end(idle=True)` is asked after a quiet
    interval, `end(idle=False)` before each read."""
    chunks, left = [], size
    while left:
        if end is not None and left == size and end(False):
            return None
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except TimeoutError:
            if end is not None and left == size and end(True):
                return None
            continue
        if not chunk:
            if left == size:
                return None
            raise ProtocolError(f"connection closed inside a frame ({size - left} of {size} bytes received)")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, end: Callable[[bool], bool] | None = None) -> tuple[bytes, bytes] | None:
    """The next (kind, payload); None when the peer closed between frames, or when `end` (see
    `_read_exactly`) ended the stream there."""
    header = _read_exactly(sock, _HEADER.size, end)
    if header is None:
        return None
    kind, size = _HEADER.unpack(header)
    if kind not in (HELLO, CASE, END) or size > MAX_FRAME:
        raise ProtocolError(f"not a pre-check frame (kind {kind!r}, {size} bytes)")
    payload = _read_exactly(sock, size) if size else b""
    if payload is None:
        raise ProtocolError(f"connection closed after the header of a {size}-byte frame")
    return kind, payload


def hello(framework: str, rank: int | None) -> bytes:
    return json.dumps({"protocol": PROTOCOL, "version": VERSION, "framework": framework, "pid": os.getpid(),
                       "rank": rank}).encode()


def parse_hello(payload: bytes) -> dict[str, Any]:
    """The sender's hello; a ProtocolError when it speaks another protocol or version."""
    try:
        info = json.loads(payload)
    except ValueError:
        raise ProtocolError("hello frame is not JSON") from None
    if not isinstance(info, dict) or info.get("protocol") != PROTOCOL or info.get("version") != VERSION:
        raise ProtocolError(f"sender speaks {info!r}; this checker speaks {PROTOCOL!r} version {VERSION}")
    return info


def server_tls(tls_path: str | None) -> ssl.SSLContext | None:
    """TLS for the checker: ``<tls_path>/server.crt`` and ``server.key`` (None: plain TCP)."""
    if not tls_path:
        return None
    cert, key = Path(tls_path) / "server.crt", Path(tls_path) / "server.key"
    missing = [str(f) for f in (cert, key) if not f.is_file()]
    if missing:
        raise RuntimeError(f"tls_path {tls_path}: {' and '.join(missing)} not found (TLS needs both)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


def client_tls(ca_file: str | None) -> ssl.SSLContext | None:
    """TLS for the sender, verifying the checker against `ca_file` (None: plain TCP)."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else None
