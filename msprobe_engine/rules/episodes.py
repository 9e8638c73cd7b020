"""From per-step firings to alert episodes: one start and one end event each."""
from __future__ import annotations

from typing import Any

from msprobe_engine.records import AlertEvent
from msprobe_engine.rules.base import Firing


class AlertTracker:
    """Turns per-step firings into start/end events, one pair per episode.

    `scope` separates evaluations of different parts of a step (e.g. what is
    known before the optimizer step and what only after it): an episode ends
    only when the scope that started it evaluates clean. The end event carries
    the value of the last step the episode fired on.
    """

    def __init__(self) -> None:
        #: episode -> (start step, first firing, last firing)
        self.active: dict[str, tuple[int, Firing, Firing]] = {}

    def update(self, step: int, firing: list[Firing], scope: str = "") -> list[AlertEvent]:
        events: list[AlertEvent] = []
        for f in firing:
            f.episode = f"{scope}{f.episode}"
        now = {f.episode: f for f in firing}
        for episode, (start, first, last) in list(self.active.items()):
            if not episode.startswith(scope):
                continue
            if episode in now:
                self.active[episode] = (start, first, now[episode])
                continue
            del self.active[episode]
            events.append(AlertEvent(first.rule, first.tag, "end", step, last.value, first.threshold,
                                     steps=step - start))
        for episode, f in now.items():
            if episode not in self.active:
                self.active[episode] = (step, f, f)
                events.append(AlertEvent(f.rule, f.tag, "start", step, f.value, f.threshold, also=f.also))
        return events

    def state_dict(self) -> dict[str, Any]:
        return {episode: {"start": start, "first": _firing(first), "last": _firing(last)}
                for episode, (start, first, last) in self.active.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.active = {episode: (int(v["start"]), Firing(**v["first"]), Firing(**v["last"]))
                       for episode, v in state.items()}


def _firing(f: Firing) -> dict[str, Any]:
    return {"rule": f.rule, "episode": f.episode, "tag": f.tag, "value": f.value, "threshold": f.threshold,
            "action": f.action, "also": list(f.also)}
