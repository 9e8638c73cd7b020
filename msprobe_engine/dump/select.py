"""Which calls and roles are dumped: ``level``, ``list``, ``scope`` and ``data_mode``.

- ``list``: full names (``Tensor.permute.1.forward``, ``Module.fc.Linear.backward.0``) select
  exactly those entries; other strings select every API (``Functional.relu``) or module
  (``Module.layers.0.mlp.MLP``) whose name contains them. In mix a selected module is
  *expanded*: everything that runs inside it is dumped too, in the directions selected
  (a listed ``...forward.0`` expands its forward, a name part both directions).
- ``scope``: ``[first, last]`` full names; per step, dumping starts when `first` begins and
  ends when `last` ends, in execution order (backward entries count when they complete).
- ``data_mode``: forward/backward and input/output combine as an intersection
  (``["forward", "input"]`` = forward inputs only); ``parameters`` count as forward inputs,
  ``parameters_grad`` as backward outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

from msprobe_engine.dump.config import DumpConfig
from msprobe_engine.dump.schema import parse_entry_name


@dataclass(frozen=True, slots=True)
class Want:
    """The decision for one call: dump its forward entry, its backward entry, expand into it."""
    forward: bool
    backward: bool
    expand: bool = False


class ScopeRange:
    """The ``scope`` state machine of one step: before `first`, inside, after `last`."""

    def __init__(self, first: str, last: str) -> None:
        self.first, self.last = first, last
        self.inside = False
        self.done = False

    def reset(self) -> None:
        self.inside = self.done = False

    def begin(self, name: str) -> bool:
        """An entry begins; True when it is inside the range."""
        if not self.inside and not self.done and name == self.first:
            self.inside = True
        return self.inside

    def end(self, name: str) -> None:
        if self.inside and name == self.last:
            self.inside, self.done = False, True


class Selection:
    """Decisions of one dump session (levels, list, scope, data_mode)."""

    def __init__(self, config: DumpConfig) -> None:
        modes = config.data_mode
        directions = {"forward", "backward"} & modes if "all" not in modes else set()
        kinds = {"input", "output"} & modes if "all" not in modes else set()
        self.forward = not directions or "forward" in directions
        self.backward = not directions or "backward" in directions
        self.inputs = not kinds or "input" in kinds
        self.outputs = not kinds or "output" in kinds
        self.modules = config.level in ("L0", "mix")
        self.apis = config.level in ("L1", "mix")
        self.expands = config.level == "mix"
        self.full_names = frozenset(n for n in config.api_list if parse_entry_name(n) is not None)
        self.parts = tuple(n for n in config.api_list if n not in self.full_names)
        self.scope = ScopeRange(*config.scope) if config.scope else None
        #: the decision for every call when no list is given (one object: `Want` is frozen)
        self._every = Want(self.forward, self.backward)

    def new_step(self) -> None:
        if self.scope:
            self.scope.reset()

    def want(self, key: str, forward_name: str, backward_name: str, outer: Want | None = None) -> Want:
        """The list decision for one call (`key`: its name without phase and counter). Inside an
        expanded module (`outer`) a call takes the module's decision: the directions it was
        selected for."""
        if outer is not None:
            return outer
        if not (self.full_names or self.parts):
            return self._every
        by_part = any(part in key for part in self.parts)
        fwd = by_part or forward_name in self.full_names
        bwd = by_part or backward_name in self.full_names
        return Want(fwd and self.forward, bwd and self.backward, expand=self.expands and (fwd or bwd))

    def begin(self, name: str) -> bool:
        """An entry begins: True when no scope is set or it falls inside the scope."""
        return self.scope is None or self.scope.begin(name)

    def end(self, name: str) -> None:
        if self.scope is not None:
            self.scope.end(name)
