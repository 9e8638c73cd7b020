"""Field metadata the config loader understands, for the components' own Config dataclasses.

    factor: float = field(default=3.0, metadata=at_least(1.0))
    action: str = field(default="continue", metadata=choices("continue", "skip", "stop"))
    regex: list[str] = field(default_factory=list, metadata=pattern())
    end_step: Optional[int] = field(default=None, metadata={**at_least(0), **above("start_step")})

Numbers are always checked to be finite, and integers to stay within `INT_LIMIT`.
"""
from __future__ import annotations

from typing import Any

#: the largest integer a config may hold (beyond it: an error, not an overflow at attach)
INT_LIMIT = 2 ** 53


def choices(*values: str) -> dict[str, Any]:
    """The value (or every item of a list) must be one of `values`."""
    return {"choices": values}


def at_least(minimum: float) -> dict[str, Any]:
    return {"min": minimum}


def between(minimum: float, maximum: float) -> dict[str, Any]:
    return {"min": minimum, "max": maximum}


def pattern() -> dict[str, Any]:
    """The value (or every item of a list) is a regular expression, compiled at load."""
    return {"regex": True}


def above(other: str) -> dict[str, Any]:
    """The value, when set, must be greater than the sibling field `other`."""
    return {"above": other}


def registered(registry: Any, key: str, shorthand: bool = False) -> dict[str, Any]:
    """A list of components: each item is a mapping whose `key` names a class of `registry`,
    built into that class's own `Config` (`shorthand`: a bare string names one with defaults)."""
    return {"registry": registry, "key": key, "shorthand": shorthand}
