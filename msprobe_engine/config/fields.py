"""Field metadata the config loader understands, for the components' own Config dataclasses.

    factor: float = field(default=3.0, metadata=at_least(1.0))
    action: str = field(default="continue", metadata=choices("continue", "skip", "stop"))
"""
from __future__ import annotations

from typing import Any


def choices(*values: str) -> dict[str, Any]:
    """The value (or every item of a list) must be one of `values`."""
    return {"choices": values}


def at_least(minimum: float) -> dict[str, Any]:
    return {"min": minimum}


def between(minimum: float, maximum: float) -> dict[str, Any]:
    return {"min": minimum, "max": maximum}


def registered(registry: Any, key: str, shorthand: bool = False) -> dict[str, Any]:
    """A list of components: each item is a mapping whose `key` names a class of `registry`,
    built into that class's own `Config` (`shorthand`: a bare string names one with defaults)."""
    return {"registry": registry, "key": key, "shorthand": shorthand}
