"""Find the tensors inside a module's inputs or outputs, with stable role names."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Iterator

log = logging.getLogger("msprobe_engine")

#: containers nested deeper than this are not walked (a structure that holds itself stops here too)
MAX_DEPTH = 32
#: role -> how many containers were left unwalked below it because they were nested too deep
too_deep: Counter[str] = Counter()


def iter_tensors(value: Any, role: str, is_tensor: Callable[[Any], bool],
                 depth: int = MAX_DEPTH) -> Iterator[tuple[str, Any]]:
    """Yield (role, tensor) for tensors in nested tuples/lists/dicts, down to `depth` levels.

    A bare tensor is `role`; element i of a sequence is `role.i`; key k of a dict
    is `role.k`. None and other non-tensor values are skipped (never counted as nan).
    A container below the depth limit is counted in `too_deep` (a warning the first time).
    """
    if is_tensor(value):
        yield role, value
    elif isinstance(value, (tuple, list, dict)):
        if depth <= 0:
            _skip(role)
            return
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            yield from iter_tensors(item, f"{role}.{key}", is_tensor, depth - 1)


def _skip(role: str) -> None:
    top = role.split(".")[0]
    if not too_deep[top]:
        log.warning("msprobe: %s: containers nested deeper than %d levels are not measured "
                    "(counted in msprobe_engine.collect.flatten.too_deep)", role, MAX_DEPTH)
    too_deep[top] += 1
