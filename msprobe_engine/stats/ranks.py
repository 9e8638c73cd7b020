"""The spread of a few per-rank scalars over a process group, found without a gather.

Each rank reduces its own rows (before the merge) to the `SCALARS` below; the merge's two
all-reduces carry each as (max, argmax) and (min, argmin) pairs plus its sum, so every rank
learns which rank holds the extreme value of a quantity that should agree, at a cost that
does not grow with the world (`frameworks.torch.distributed`). The values come to the host
with the step's rows, as rows of kind `KIND` that the tables strip off (`StatTable.ranks`).

- `nonfinite`: the nan and inf values this rank measured (every row it holds);
- `grad_norm`: the norm of this rank's replicated gradients (the rows its group takes once:
  DDP's, Megatron's without the distributed optimizer), which every rank must hold alike;
- `loss`: this rank's mean loss (its own data: comparable, not equal).

The median is not known without a gather; the reference an extreme is compared with is the
mean of the ranks between the extremes, ``(sum - max - min) / (world - 2)`` (with two ranks: the
other one): with one odd rank among agreeing ones it is their common value, whichever side the odd
one is on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

#: the per-rank scalars, in the order they travel
SCALARS = ("nonfinite", "grad_norm", "loss")
#: what the sum of each is for: `holders` (how many ranks hold a non-finite value) travels too
PARTS = ("max", "argmax", "min", "argmin", "sum")
#: the kind of the rows that carry the spread through the transfer (stripped off the tables)
KIND = "ranks"
#: the row names, in order: the world size, each scalar's parts, then `holders`
NAMES: tuple[str, ...] = ("world", *(f"{s}/{p}" for s in SCALARS for p in PARTS), "holders")

#: what each scalar is called in a sentence
_SAID = {"grad_norm": "gradient norm", "loss": "loss"}


@dataclass(frozen=True)
class Extreme:
    """One rank's value of `scalar` far from the other ranks': `ratio` times (or below) the mean of
    the ranks between the extremes (`reference`)."""
    scalar: str
    rank: int
    value: float
    reference: float
    ratio: float
    high: bool


@dataclass(frozen=True)
class RankSpread:
    """The spread of `SCALARS` over `world` ranks (`values`: name in `NAMES` -> value)."""
    values: dict[str, float]

    @classmethod
    def of(cls, values: Sequence[float]) -> "RankSpread":
        return cls(dict(zip(NAMES, (float(v) for v in values))))

    @property
    def world(self) -> int:
        return int(self.values["world"])

    def get(self, scalar: str, part: str) -> float:
        return self.values[f"{scalar}/{part}"]

    def nonfinite_holder(self) -> int | None:
        """The rank holding the most nan/inf values (the lowest of a tie), None when no rank holds one."""
        return int(self.get("nonfinite", "argmax")) if self.get("nonfinite", "max") > 0 else None

    def extremes(self, factor: float) -> list[Extreme]:
        """The ranks whose `grad_norm` or `loss` is more than `factor` x the mean of the ranks between
        the extremes, or less than 1/`factor` of it (at most one each way per scalar; with two
        ranks, the higher one only)."""
        found = []
        world = self.world
        if world < 2:
            return found
        for scalar in SCALARS[1:]:
            total, most, least = self.get(scalar, "sum"), self.get(scalar, "max"), self.get(scalar, "min")
            middle = (total - most - least) / (world - 2) if world > 2 else None
            for part, high in (("max", True), ("min", False)):
                value = self.get(scalar, part)
                reference = middle if middle is not None else total - value
                if not (math.isfinite(value) and math.isfinite(reference)):
                    continue  # non-finite: `nonfinite` names it
                if high and value > factor * abs(reference) and value > 0:
                    ratio = value / reference if reference else math.inf
                elif not high and reference > 0 and value * factor < reference:
                    ratio = reference / value if value > 0 else math.inf
                else:
                    continue
                found.append(Extreme(scalar, int(self.get(scalar, "arg" + part)), value, reference, ratio, high))
                if world == 2:
                    break  # two ranks apart: one event, named by the higher one (which is odd is unknowable)
        return found

    def nonfinite_sentence(self) -> str:
        rank, holders = self.nonfinite_holder(), int(self.values["holders"])
        others = "" if holders <= 1 else f" ({holders} of the {self.world} ranks hold non-finite values; it holds the most)"
        return f"rank {rank} of {self.world} holds the nan{others}"

    def as_dict(self) -> dict[str, float]:
        return dict(self.values)


def sentence(extreme: Extreme, world: int) -> str:
    """E.g. "rank 12's gradient norm is 40x the mean of the 1022 ranks between the extremes (...)"."""
    what = _SAID.get(extreme.scalar, extreme.scalar)
    how = f"{extreme.ratio:.3g}x" if extreme.high else f"1/{extreme.ratio:.3g} of"
    others = f"the mean of the {world - 2} ranks between the extremes" if world > 2 else "the other rank's"
    return f"rank {extreme.rank}'s {what} is {how} {others} ({extreme.value:.6g} against {extreme.reference:.6g})"
