"""Pair the entries of two dumps whose call sequences may differ (tools, versions, refactors).

Passes, each over the entries the earlier ones left:

1. ``name``: the same entry name on both sides.
2. ``spelling``: the same name once spellings are made one: ``parameters_grad`` (the
   predecessor's 1.x) is ``parameters_grad.0`` (26.2).
3. ``site``: the same name without its call counter (``Functional.relu.forward``) left once on
   each side.
4. ``order``: the same name without counter, paired in call order (the k-th left in A with
   the k-th left in B); then the same API written another way (``x + y`` is
   ``Tensor.__add__``, ``x.add(y)`` is ``Tensor.add``; ``__iadd__`` is ``add_``), in call order.
5. ``signature``: the same direction and the same tensors (dtype and shape of each, in order),
   with the closest statistics (Max/Min/Mean/Norm), if within 1 % of each other.

What is left is reported as ``only_a`` / ``only_b``. Pairs come in A's execution order, each
B-only entry after the pair that precedes it in B.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

from msprobe_engine.dump.schema import iter_tensors, parse_entry_name

#: how a pair was made, in pass order
PASSES = ("name", "spelling", "site", "order", "signature")
#: largest relative distance of statistics for a `signature` pair
SIGNATURE_TOLERANCE = 0.01
_OPERATOR_RE = re.compile(r"^__(r|i)?(.+?)__$")
_OPERATOR_METHODS = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "matmul": "matmul",
                     "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor", "lshift": "bitwise_left_shift",
                     "rshift": "bitwise_right_shift", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq",
                     "ne": "ne"}


@dataclass(frozen=True, slots=True)
class Pair:
    """Two matched entries (one side None when unmatched) and how they were matched
    (one of `PASSES`, ``only_a`` or ``only_b``)."""
    a: str | None
    b: str | None
    how: str


def call_site(name: str) -> str:
    """The entry name without its call counter; unknown names stay as they are."""
    parsed = parse_entry_name(name)
    return parsed.key if parsed else name


def spelling(name: str) -> str:
    """One spelling for names the predecessor's releases write differently."""
    parsed = parse_entry_name(name)
    if parsed is not None and parsed.phase == "parameters_grad" and parsed.counter is None:
        return f"{name}.0"
    return name


def api_family(name: str) -> str:
    """The call site with Tensor operators named as their methods (``Tensor.__iadd__`` -> ``Tensor.add_``)."""
    parsed = parse_entry_name(name)
    if parsed is None:
        return name
    target = parsed.target
    if parsed.prefix == "Tensor" and (m := _OPERATOR_RE.match(target)):
        method = _OPERATOR_METHODS.get(m.group(2), m.group(2))
        target = f"{method}_" if m.group(1) == "i" else method
    return f"{parsed.prefix}.{target}.{parsed.phase}"


def _signature(name: str, entry: Any) -> tuple:
    parsed = parse_entry_name(name)
    tensors = tuple((r.label, r.record.get("dtype"), tuple(r.record.get("shape") or ()))
                    for r in iter_tensors(name, entry)) if isinstance(entry, dict) else ()
    return (parsed.phase if parsed else None, tensors)


def _values(name: str, entry: Any) -> list[float]:
    if not isinstance(entry, dict):
        return []
    return [v for r in iter_tensors(name, entry) for k in ("Max", "Min", "Mean", "Norm")
            if (v := r.stat(k)) is not None and math.isfinite(v)]


def _distance(x: list[float], y: list[float]) -> float:
    if len(x) != len(y):
        return math.inf
    return max((abs(a - b) / max(abs(a), abs(b), 1e-12) for a, b in zip(x, y)), default=0.0)


class _Matcher:
    def __init__(self, names_a: list[str], names_b: list[str]) -> None:
        self.names_a, self.names_b = names_a, names_b
        self.a_to_b: dict[int, tuple[int, str]] = {}
        self.left_b = set(range(len(names_b)))

    def left_a(self) -> list[int]:
        return [i for i in range(len(self.names_a)) if i not in self.a_to_b]

    def pair(self, i: int, j: int, how: str) -> None:
        self.a_to_b[i] = (j, how)
        self.left_b.discard(j)

    def by_key(self, key, how: str, unique: bool = False) -> None:
        """Pair what is left by `key(name)`, in call order (with `unique`: only keys left once each side)."""
        side_a: dict[str, list[int]] = defaultdict(list)
        side_b: dict[str, list[int]] = defaultdict(list)
        for i in self.left_a():
            side_a[key(self.names_a[i])].append(i)
        for j in sorted(self.left_b):
            side_b[key(self.names_b[j])].append(j)
        for k, indices in side_a.items():
            others = side_b.get(k, [])
            if unique and (len(indices) != 1 or len(others) != 1):
                continue
            for i, j in zip(indices, others):
                self.pair(i, j, how)

    def by_signature(self, data_a: dict, data_b: dict) -> None:
        candidates: dict[tuple, list[int]] = defaultdict(list)
        for j in sorted(self.left_b):
            candidates[_signature(self.names_b[j], data_b.get(self.names_b[j]))].append(j)
        for i in self.left_a():
            name = self.names_a[i]
            sig = _signature(name, data_a.get(name))
            if not sig[1]:
                continue
            values = _values(name, data_a.get(name))
            pool = [j for j in candidates.get(sig, []) if j in self.left_b]
            scored = [(_distance(values, _values(self.names_b[j], data_b.get(self.names_b[j]))), j) for j in pool]
            best = min(scored, default=None)
            if best is not None and best[0] <= SIGNATURE_TOLERANCE:
                self.pair(i, best[1], "signature")

    def pairs(self) -> list[Pair]:
        order: list[tuple[float, Pair]] = []
        for i, name in enumerate(self.names_a):
            if i in self.a_to_b:
                j, how = self.a_to_b[i]
                order.append((i, Pair(name, self.names_b[j], how)))
            else:
                order.append((i, Pair(name, None, "only_a")))
        a_of_b = {j: i for i, (j, _) in self.a_to_b.items()}
        place = -1.0
        for j, name in enumerate(self.names_b):
            if j in a_of_b:
                place = a_of_b[j]
            elif j in self.left_b:
                place += 1e-6
                order.append((place + 0.5, Pair(None, name, "only_b")))
        return [p for _, p in sorted(order, key=lambda item: item[0])]


def match_entries(names_a: list[str], names_b: list[str], data_a: dict | None = None,
                  data_b: dict | None = None) -> tuple[list[Pair], bool]:
    """Pairs (see the module docstring) and whether any pair was made by another pass than ``name``.
    `data_a`/`data_b` (the dumps' ``data``) enable the ``signature`` pass."""
    matcher = _Matcher(names_a, names_b)
    index_b = {n: j for j, n in enumerate(names_b)}
    for i, name in enumerate(names_a):
        if name in index_b:
            matcher.pair(i, index_b[name], "name")
    matcher.by_key(spelling, "spelling")
    matcher.by_key(call_site, "site", unique=True)
    matcher.by_key(call_site, "order")
    matcher.by_key(api_family, "order")
    if data_a is not None and data_b is not None:
        matcher.by_signature(data_a, data_b)
    pairs = matcher.pairs()
    return pairs, any(p.how not in ("name", "only_a", "only_b") for p in pairs)


def count_by_pass(pairs: Iterable[Pair]) -> dict[str, int]:
    """How many pairs each pass made, and how many entries stayed unmatched on each side."""
    counts = dict.fromkeys(PASSES + ("only_a", "only_b"), 0)
    for p in pairs:
        counts[p.how] += 1
    return counts
