"""Pair the entries of two dumps.

When both dumps hold the same entry names, entries pair by name. Otherwise call counters
have shifted (an extra call in one run renames every later call of that API/module), so
entries pair by call site and order: each name loses its counter (``Functional.relu.3.forward``
-> ``Functional.relu.forward``) and the two sequences of call sites, in execution order, are
aligned: the common head of call sites pairs position by position, the common tail of
identical names pairs as is, and the rest is aligned by longest matching blocks
(``difflib.SequenceMatcher``), which, between equally good alignments, keeps the earliest.
Entries left without a partner are reported as unmatched.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from msprobe_engine.dump.schema import parse_entry_name


@dataclass(frozen=True, slots=True)
class Pair:
    """Two matched entries (one side None when unmatched) and how they were matched."""
    a: str | None
    b: str | None
    how: str  # "name", "order" (call site and position), "only_a", "only_b"


def call_site(name: str) -> str:
    """The entry name without its call counter; unknown names stay as they are."""
    parsed = parse_entry_name(name)
    return parsed.key if parsed else name


def _pair(a: str, b: str) -> Pair:
    return Pair(a, b, "name" if a == b else "order")


def match_entries(names_a: list[str], names_b: list[str]) -> tuple[list[Pair], bool]:
    """Pairs in execution order (B-only entries at their aligned place) and whether the
    order fallback was used."""
    if set(names_a) == set(names_b):
        return [Pair(n, n, "name") for n in names_a], False
    sites_a = [call_site(n) for n in names_a]
    sites_b = [call_site(n) for n in names_b]
    head = 0
    while head < min(len(sites_a), len(sites_b)) and sites_a[head] == sites_b[head]:
        head += 1
    tail = 0
    while (tail < min(len(names_a), len(names_b)) - head
           and names_a[-1 - tail] == names_b[-1 - tail]):
        tail += 1
    pairs = [_pair(names_a[i], names_b[i]) for i in range(head)]
    mid_a, mid_b = sites_a[head:len(sites_a) - tail], sites_b[head:len(sites_b) - tail]
    matcher = difflib.SequenceMatcher(None, mid_a, mid_b, autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op == "equal":
            pairs += [_pair(names_a[head + a0 + k], names_b[head + b0 + k]) for k in range(a1 - a0)]
            continue
        pairs += [Pair(names_a[head + i], None, "only_a") for i in range(a0, a1)]
        pairs += [Pair(None, names_b[head + i], "only_b") for i in range(b0, b1)]
    pairs += [_pair(names_a[len(names_a) - tail + k], names_b[len(names_b) - tail + k]) for k in range(tail)]
    return pairs, True
