"""The predecessor's ignore-rule file (``ignore_nan_inf:`` with ``api_name``, ``description``,
``input_ignore: [{index: i} | {name: n}]``, ``output_ignore: [{index: i}]``) as our rule items
(``api``, ``why``, ``inputs``, ``outputs``), so `analyze --rules` reads either file."""
from __future__ import annotations

from pathlib import Path
from typing import Any

PREDECESSOR_KEY = "ignore_nan_inf"


def from_predecessor(items: Any, path: Path) -> list[dict[str, Any]]:
    """Our rule items for the predecessor's list; a ValueError names the rule and key."""
    if not isinstance(items, list):
        raise ValueError(f"{path}: {PREDECESSOR_KEY}: expected a list of rules")
    rules = []
    for i, item in enumerate(items):
        where = f"{path}: {PREDECESSOR_KEY}[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a mapping with api_name")
        inputs = [value for entry in _entries(item, "input_ignore", where) for key, value in entry.items()
                  if key in ("index", "name")]
        outputs = [entry["index"] for entry in _entries(item, "output_ignore", where) if "index" in entry]
        rules.append({"api": item.get("api_name"), "why": item.get("description", ""),
                      "inputs": inputs, "outputs": outputs})
    return rules


def _entries(item: dict, key: str, where: str) -> list[dict]:
    entries = item.get(key) or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{where}.{key}: expected a list of {{index: <n>}} or {{name: <keyword>}}")
    return entries
