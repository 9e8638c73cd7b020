"""Module selection by exact name, regex and class name (config `modules`)."""
from __future__ import annotations

import re

from msprobe_engine.config.schema import ModuleSelection


class ModuleFilter:
    """Decides which module paths are watched; everything when no list is given."""

    def __init__(self, spec: ModuleSelection) -> None:
        self.names = set(spec.names)
        self.patterns = [re.compile(p) for p in spec.regex]
        self.types = set(spec.types)
        self.excluded = [re.compile(p) for p in spec.exclude_regex]
        self.everything = not (self.names or self.patterns or self.types)

    def __call__(self, path: str, class_name: str) -> bool:
        if any(p.search(path) for p in self.excluded):
            return False
        if self.everything:
            return True
        return (path in self.names or class_name in self.types
                or any(p.search(path) for p in self.patterns))

    def unmatched_names(self, paths: set[str]) -> list[str]:
        """Exact names from the config that no module has (reported at attach time)."""
        return sorted(self.names - paths)
