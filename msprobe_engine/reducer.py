"""What merges a step's rows over the framework's process groups: the `Reducer` an integration
hands the `Monitor` (`Monitor(config, reducer=...)`), called once per transfer."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from msprobe_engine.incident.actions import StepDecision
    from msprobe_engine.stats.table import MetricKey


class Reducer:
    """Base of the reducers (DeepSpeed's, Megatron's, DDP/FSDP2's, MindSpore's); a subclass
    implements `merge` and keeps the defaults it does not need to change."""

    #: a step replay's rows are merged too (every rank replays the step together)
    replays_together: bool = False

    def merge(self, keys: Sequence["MetricKey"], rows: Any) -> Any:
        """The packed rows of `keys` (one per key, on the device), merged over the groups: the
        same keys in the same order on every rank; one collective per group."""
        raise NotImplementedError

    def complete(self, keys: list["MetricKey"], steps: Any, rows: Any) -> tuple[list["MetricKey"], Any, Any]:
        """Before `merge`: (keys, steps, rows) with the rows only other ranks measured added as
        empty rows (the merge's identity), so that every rank merges one layout (ranks holding
        different layers: pipeline stages). By default as they are."""
        return keys, steps, rows

    def spread(self) -> Any:
        """After `merge`: the spread of the per-rank scalars over the data-parallel group
        (`stats.ranks`) as rows of kind `ranks.KIND` in `ranks.NAMES` order, on the device, which
        travel with the merged rows; None where the reducer finds none."""
        return None

    def agree(self, decision: "StepDecision") -> "StepDecision":
        """The skip/stop decision, the same on every rank (called on every rank when a rule can
        skip or stop). By default the rules saw the same merged rows on every rank: as it is."""
        return decision
