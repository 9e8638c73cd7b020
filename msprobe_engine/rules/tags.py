"""What a metric rule watches (tags or glob patterns) and how a step's hits become one episode.

A spike in one layer shows in that layer, in every parent module that returns its output,
and downstream of it: all of that is one event. `one_episode` reports it as one `Firing`
named after the innermost module of the first hit (execution order), with the other tags
in `also` and every hit in `parts` (so that `AlertTracker` follows its episodes per tag).
"""
from __future__ import annotations

import fnmatch
from typing import Iterator

from msprobe_engine.rules.base import Firing, Rule

#: at most this many other tags are listed in a firing's `also` (then "+N more")
MAX_ALSO = 20


class TagMatcher:
    """Which metric tags match `patterns` (exact tags or globs), each decided once."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = list(patterns)
        globbing = any(ch in p for p in patterns for ch in "*?[")
        self._exact: list[str] | None = None if globbing else list(patterns)
        self._matches: dict[str, bool] = {}
        self._scanned: list[str] = []  # the tags of the last metrics scanned, in order
        self._hits: list[str] = []  # those of them that match

    def __call__(self, tag: str) -> bool:
        hit = self._matches.get(tag)
        if hit is None:
            hit = self._matches[tag] = any(fnmatch.fnmatchcase(tag, p) for p in self.patterns)
        return hit

    def candidates(self, metrics: dict[str, float]) -> Iterator[tuple[str, float]]:
        """(tag, value) of the watched metrics, in the order of `metrics` (execution order)."""
        if self._exact is not None:  # plain tag names: direct look-ups, no scan
            return ((tag, metrics[tag]) for tag in self._exact if tag in metrics)
        tags = list(metrics)
        if tags != self._scanned:  # a new layout of tags (a step repeats the last one's: no scan)
            self._scanned, self._hits = tags, [tag for tag in tags if self(tag)]
        return ((tag, metrics[tag]) for tag in self._hits)


def _parts(tag: str) -> tuple[str, str, str]:
    """`kind/path/rest` -> (kind, module path without a call suffix, rest)."""
    kind, _, tail = tag.partition("/")
    path, _, rest = tail.partition("/")
    return kind, path.split(":")[0], rest


def _related(a: str, b: str) -> bool:
    """One module path contains the other (or they are the same module)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def innermost(tags: list[str]) -> int:
    """Index of the tag to name an event after: among the tags of the first one's module, its
    parents and children (same kind and statistic), the deepest module."""
    kind, path, rest = _parts(tags[0])
    best, depth = 0, path.count(".")
    for i, tag in enumerate(tags[1:], 1):
        k, p, r = _parts(tag)
        if k == kind and r == rest and _related(p, path) and p.count(".") > depth:
            best, depth = i, p.count(".")
    return best


Hit = tuple[str, float, float | None]  # (tag, value, threshold)


def one_episode(rule: Rule, hits: list[Hit]) -> list[Firing]:
    """All of a step's (tag, value, threshold) hits of `rule` as one firing (one episode)."""
    if not hits:
        return []
    return [grouped(hits, rule.name, rule.name, rule.action, rule.config.cooldown)]


def grouped(hits: list[Hit], rule: str, episode: str, action: str, cooldown: int) -> Firing:
    """`hits` (at least one) as one firing named after the innermost module of the first hit,
    the other tags in `also` (at most `MAX_ALSO`), every hit in `parts`."""
    lead = innermost([tag for tag, _, _ in hits])
    tag, value, threshold = hits[lead]
    others = [t for i, (t, _, _) in enumerate(hits) if i != lead]
    if len(others) > MAX_ALSO:
        others = others[:MAX_ALSO] + [f"+{len(others) - MAX_ALSO} more"]
    return Firing(rule, episode, tag, value, threshold, action, also=tuple(others), cooldown=cooldown,
                  parts=tuple(hits))
