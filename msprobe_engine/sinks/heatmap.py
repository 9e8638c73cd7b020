"""Heatmaps of per-layer norms (layers x steps, log scale) as PNG images, with numpy only.

Rows are the layers in execution order (first seen first), columns the last monitored
steps, the colour log10 of the norm on a dark-blue-to-yellow scale spanning the finite
values shown. Non-finite cells are marked: nan magenta, inf red; a layer not measured at
a step is grey. Everything here runs on the writer thread.
"""
from __future__ import annotations

import math
import struct
import zlib
from collections import deque

import numpy as np

#: colour stops of the scale (low to high), interpolated linearly
SCALE = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)
NAN_RGB, POS_INF_RGB, MISSING_RGB = (255, 0, 255), (255, 0, 0), (128, 128, 128)
MAX_WIDTH, MAX_HEIGHT = 1200, 800  # pixels: cells grow to fill at most this


class NormHistory:
    """The last `steps` monitored steps of the norms of one set of tags (e.g. every
    ``actv/<module>/output/norm``), in the order the tags were first seen."""

    def __init__(self, steps: int) -> None:
        self.rows: dict[str, int] = {}
        self.columns: deque[tuple[int, dict[str, float]]] = deque(maxlen=steps)

    def add(self, step: int, values: dict[str, float]) -> None:
        for tag in values:
            self.rows.setdefault(tag, len(self.rows))
        self.columns.append((step, values))

    def matrix(self) -> np.ndarray:
        """[layers, steps], nan-free except for measured nans; -inf marks a missing cell."""
        out = np.full((len(self.rows), len(self.columns)), -np.inf)
        for j, (_, values) in enumerate(self.columns):
            for tag, value in values.items():
                out[self.rows[tag], j] = value
        return out

    def steps(self) -> tuple[int, int]:
        return self.columns[0][0], self.columns[-1][0]


def heatmap_rgb(norms: np.ndarray) -> np.ndarray:
    """[layers, steps] norms -> [layers, steps, 3] uint8 (see the module docstring).
    -inf is a missing cell; a norm of 0 takes the bottom of the scale."""
    missing = np.isneginf(norms)
    nan, pos_inf = np.isnan(norms), np.isposinf(norms)
    finite = ~(missing | nan | pos_inf)
    with np.errstate(divide="ignore"):
        logs = np.log10(np.where(finite, norms, 1.0))
    shown = logs[finite & np.isfinite(logs)]
    low, high = (shown.min(), shown.max()) if shown.size else (0.0, 1.0)
    scaled = np.clip((np.where(np.isfinite(logs), logs, low) - low) / max(high - low, 1e-12), 0.0, 1.0)
    position = scaled * (len(SCALE) - 1)
    lower = np.minimum(position.astype(np.int64), len(SCALE) - 2)
    weight = (position - lower)[..., None]
    rgb = SCALE[lower] * (1 - weight) + SCALE[lower + 1] * weight
    rgb[nan], rgb[pos_inf], rgb[missing] = NAN_RGB, POS_INF_RGB, MISSING_RGB
    return rgb.round().astype(np.uint8)


def enlarge(rgb: np.ndarray) -> np.ndarray:
    """Repeat cells so that the image is readable (at most MAX_WIDTH x MAX_HEIGHT)."""
    rows, cols = rgb.shape[:2]
    up_y = max(1, min(24, MAX_HEIGHT // max(rows, 1)))
    up_x = max(1, min(24, MAX_WIDTH // max(cols, 1)))
    return np.repeat(np.repeat(rgb, up_y, axis=0), up_x, axis=1)


def png(rgb: np.ndarray) -> bytes:
    """Encode [height, width, 3] uint8 as PNG (8-bit RGB, no filter)."""
    height, width = rgb.shape[:2]
    raw = np.concatenate([np.zeros((height, 1), dtype=np.uint8), rgb.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + \
        chunk(b"IEND", b"")


def legend(history: NormHistory, norms: np.ndarray, limit: int = 40) -> str:
    """Markdown naming the rows (top to bottom), the steps and the colour range."""
    finite = norms[np.isfinite(norms)]
    first, last = history.steps()
    span = f"{finite.min():.3g} .. {finite.max():.3g}" if finite.size else "none finite"
    names = list(history.rows)
    shown = ", ".join(f"{i}: `{name}`" for i, name in enumerate(names[:limit]))
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    bad = [names[i] for i in np.flatnonzero((np.isnan(norms) | np.isposinf(norms)).any(axis=1))]
    marked = f" Non-finite rows: {', '.join(f'`{n}`' for n in bad[:10])}." if bad else ""
    return (f"Steps {first}..{last} left to right; norms {span} (log scale, blue low, yellow high; "
            f"magenta nan, red inf, grey not measured).{marked} Rows top to bottom: {shown}{more}")


def log_bins(values: np.ndarray, bins: int = 30) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Histogram of log10 of the finite positive `values`: (counts, right bucket edges, the logs)."""
    values = values[np.isfinite(values) & (values > 0)]
    if not values.size:
        return None
    logs = np.log10(values)
    low, high = float(logs.min()), float(logs.max())
    if math.isclose(low, high):
        low, high = low - 0.5, high + 0.5
    counts, edges = np.histogram(logs, bins=bins, range=(low, high))
    return counts, edges[1:], logs
