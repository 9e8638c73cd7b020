"""``collectives``: the training's own ``torch.distributed`` collectives of each monitored step,
per op kind (`collective_calls.KINDS`, all groups together): ``comm/<kind>/calls/<stat>`` and
``comm/<kind>/bytes/<stat>`` (what this rank handed to them; see `collective_calls` for what is
seen). Counted on the host from the tensors' sizes, no device work and no host sync; every kind
has its two rows every step (zeros included), so every rank has the same rows and they merge:
with a merged (DDP) run, ``mean`` is the ranks' mean, ``max``/``min`` the busiest/idlest rank.
The monitor's own collectives (its statistics merge) are not counted."""
from __future__ import annotations

from typing import Any

import torch

from msprobe_engine.frameworks.torch import collective_calls
from msprobe_engine.frameworks.torch.health_hooks import Signal, register_signal
from msprobe_engine.stats.table import MetricKey

KIND = "comm"


@register_signal("collectives")
class Collectives(Signal):
    """Listens to the collectives (`collective_calls.listen`); adds the step's rows first in `step_end`."""

    key = "collectives"

    def __init__(self, monitor: Any, model: torch.nn.Module, optimizer: Any) -> None:
        super().__init__(monitor, model, optimizer)
        self.keys = [MetricKey(KIND, kind, role) for kind in collective_calls.KINDS for role in ("calls", "bytes")]
        self._at = {kind: 2 * i for i, kind in enumerate(collective_calls.KINDS)}
        self._counts = [0] * len(self.keys)
        self.handles.append(collective_calls.listen(self._called))
        monitor.add_step_closer(self)

    def _called(self, kind: str, nbytes: int) -> None:
        if self.measuring():
            at = self._at[kind]
            self._counts[at] += 1
            self._counts[at + 1] += nbytes

    def close_step(self, loss: Any) -> Any:
        """The step's counts as rows (then zero again)."""
        counts, self._counts = self._counts, [0] * len(self.keys)
        if self.measuring():
            with self.monitor.guard("collectives step rows"):
                self.monitor.add_tensors(self.keys, list(torch.tensor(counts, dtype=torch.float64).unbind()))
        return loss

    def step_closed(self) -> None:
        """Nothing: the counts were taken in `close_step`."""
