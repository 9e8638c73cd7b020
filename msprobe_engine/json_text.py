"""Numbers as text, encoded in C (orjson): the metric sinks' lines and the dumps' non-finite values.

`repr` of a float costs about 0.45 us of Python with the GIL held; the text sinks of a step of
2,000 metrics spent about 3 ms of the writer thread's GIL time on it, which the training thread
waits for. orjson writes the shortest text that reads back as the same float (``float(text)``),
about a tenth of that. Its spelling is JSON's and differs from `repr` in places (``0.00001`` for
``1e-05``, ``2.5e-7`` for ``2.5e-07``); a nan or an infinity, which orjson writes as ``null``,
gets the text each format wants.
"""
from __future__ import annotations

from typing import Sequence

import orjson

_SPECIAL = {text: orjson.Fragment(text.encode()) for text in ("NaN", "Infinity", "-Infinity")}


def json_special(value: float) -> orjson.Fragment:
    """A non-finite float as JSON text as Python's json and the predecessor write it (``NaN``,
    ``Infinity``, ``-Infinity``): orjson would write null."""
    return _SPECIAL["NaN" if value != value else "Infinity" if value > 0 else "-Infinity"]


def finite(values: Sequence[float | int]) -> bool:
    """Whether no value is a nan or an infinity (one sum: a false False where finite values
    overflow it, which only sends the caller down its slower path)."""
    total = sum(values)
    return total - total == 0


def number_texts(values: Sequence[float | int]) -> list[bytes]:
    """Each plain float or int as the shortest text that reads back as it (orjson's spelling); a
    nan or an infinity as `repr` writes it (``nan``, ``inf``, ``-inf``)."""
    if not values:
        return []
    try:
        blob = orjson.dumps(values if isinstance(values, list) else list(values))
    except orjson.JSONEncodeError:  # an int beyond 64 bits
        return [repr(value).encode() for value in values]
    texts = blob[1:-1].split(b",")
    if b"n" in blob:  # a null: orjson's text of a number has no n
        texts = [repr(value).encode() if text == b"null" else text for text, value in zip(texts, values)]
    return texts


def metrics_json(metrics: dict[str, float | int]) -> bytes:
    """`metrics` (plain floats and ints) as a JSON object, nan and infinities as `json_special`
    (raises `orjson.JSONEncodeError` for an int beyond 64 bits)."""
    values = metrics.values()
    if not finite(values):
        metrics = {tag: value if value - value == 0 else json_special(value) for tag, value in metrics.items()}
    return orjson.dumps(metrics)
