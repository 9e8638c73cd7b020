"""The one error type of configuration problems, and where a file's text stops being UTF-8."""
from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key path."""


def utf8_error(exc: UnicodeDecodeError) -> str:
    """Where decoding failed, as ``line L, column C: byte 0xNN is not UTF-8`` (counted in the
    bytes that were decoded: whole files, see `read_utf8`)."""
    data, at = exc.object, exc.start
    line = data.count(b"\n", 0, at) + 1
    column = at - data.rfind(b"\n", 0, at)
    return f"line {line}, column {column}: byte 0x{data[at]:02x} is not UTF-8"


def read_utf8(path: Path) -> str:
    """The text of `path`; a byte that is not UTF-8 raises ValueError naming the file, line and column."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: {utf8_error(exc)}") from None
