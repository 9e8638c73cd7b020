"""What an incident says about the ranks: the odd rank named in words, from the spread of the
per-rank scalars the merge found (`stats.ranks`), on every rank, without a gather."""
from __future__ import annotations

from typing import Any, Sequence

from msprobe_engine.records import AlertEvent
from msprobe_engine.stats.ranks import RankSpread, sentence


def named_ranks(spread: RankSpread, events: Sequence[AlertEvent]) -> set[int]:
    """The ranks an incident names: the one holding the most nan/inf values, and those a
    `rank_outlier` alert starting among `events` is tagged with (`ranks/rank<R>/...`)."""
    named = {spread.nonfinite_holder()} - {None}
    for event in events:
        if event.rule == "rank_outlier" and event.phase == "start" and event.tag.startswith("ranks/rank"):
            named.add(int(event.tag.split("/")[1][len("rank"):]))
    return named


def rank_report(spread: RankSpread, events: Sequence[AlertEvent]) -> dict[str, Any]:
    """``{"world", "said": [sentences], "spread": {...}}``: the rank holding nan/inf values, and the
    ranks `rank_outlier` named among `events` (at the factor it fired with)."""
    said = [spread.nonfinite_sentence()] if spread.nonfinite_holder() is not None else []
    for event in events:
        if (event.rule != "rank_outlier" or event.phase != "start" or event.tag.endswith("/nonfinite")
                or not event.threshold):
            continue
        said += [sentence(found, spread.world) for found in spread.extremes(event.threshold)
                 if event.tag == f"ranks/rank{found.rank}/{found.scalar}"]
    return {"world": spread.world, "said": said, "spread": spread.as_dict()}
