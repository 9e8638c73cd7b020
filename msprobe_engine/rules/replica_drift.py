"""`replica_drift`: a data-parallel replica whose parameters differ from the other replicas'.

Replicas must hold bit-identical parameters (DDP, the replicate dimension of HSDP). Every
`every` monitored steps each replica hashes its parameters on the device (a checksum per
bucket of about `bucket_numel` elements), the hashes are gathered and compared; a bucket
whose hash differs from the one most replicas hold (ties: the lowest rank's) is reported as
the rows `train/replica_drift/rank<R>/<parameter>`, for every parameter of that bucket (the
torch integration's `frameworks.torch.replica_drift`). This rule raises one alert per rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from msprobe_engine.fields import at_least
from msprobe_engine.rules.base import Firing, Rule, register_rule

#: the path prefix of the rows the replica check adds (`train/replica_drift/rank<R>/<param>`)
PREFIX = "replica_drift/"


@register_rule("replica_drift")
class ReplicaDriftRule(Rule):
    """One alert per drifting rank, tagged with its first drifting parameter, the others in
    `also`; the value is how many of its parameters differ."""

    @dataclass(kw_only=True, slots=True)
    class Config(Rule.Config):
        every: int = field(default=100, metadata=at_least(1))
        bucket_numel: int = field(default=1 << 24, metadata=at_least(1))

    def evaluate(self, table, stats, metrics) -> list[Firing]:
        by_rank: dict[str, list[str]] = {}
        for key in table.keys:
            if key.kind == "train" and key.path.startswith(PREFIX):
                rank = key.path[len(PREFIX):].split("/", 1)[0]
                by_rank.setdefault(rank, []).append(f"train/{key.path}")
        return [Firing(self.name, f"{self.name}:{rank}", tags[0], float(len(tags)), 0.0, self.action,
                       also=tuple(tags[1:])) for rank, tags in by_rank.items()]
