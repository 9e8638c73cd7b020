"""Find the tensors inside a module's inputs or outputs, with stable role names."""
from __future__ import annotations

from typing import Any, Callable, Iterator


def iter_tensors(value: Any, role: str, is_tensor: Callable[[Any], bool],
                 depth: int = 3) -> Iterator[tuple[str, Any]]:
    """Yield (role, tensor) for tensors in nested tuples/lists/dicts.

    A bare tensor is `role`; element i of a sequence is `role.i`; key k of a dict
    is `role.k`. None and other non-tensor values are skipped (never counted as nan).
    """
    if is_tensor(value):
        yield role, value
    elif depth > 0 and isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from iter_tensors(item, f"{role}.{i}", is_tensor, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for key, item in value.items():
            yield from iter_tensors(item, f"{role}.{key}", is_tensor, depth - 1)
