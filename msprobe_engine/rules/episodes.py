"""From per-step firings to alert episodes: one start and one end event each."""
from __future__ import annotations

from typing import Any

from msprobe_engine.records import AlertEvent
from msprobe_engine.rules.base import Firing


class AlertTracker:
    """Turns per-step firings into start/end events, one pair per episode.

    `scope` separates evaluations of different parts of a step (e.g. what is
    known before the optimizer step and what only after it): an episode ends
    only when the scope that started it evaluates clean, `cooldown` times in a
    row after its last firing (the firing's own `cooldown`; 0: at once). The end
    event carries the value of the last step the episode fired on.

    An episode that starts in one scope while the same episode of another scope is open
    (a nan in the activations, then, after the optimizer step, in the weights it reached)
    is the same event: it is tracked, but it starts and ends silently.
    """

    def __init__(self) -> None:
        #: episode -> (start step, first firing, last firing, clean evaluations since)
        self.active: dict[str, tuple[int, Firing, Firing, int]] = {}
        #: episodes that joined an open one of another scope (no start or end event of their own)
        self.silent: set[str] = set()

    def update(self, step: int, firing: list[Firing], scope: str = "") -> list[AlertEvent]:
        events: list[AlertEvent] = []
        for f in firing:
            f.episode = f"{scope}{f.episode}"
        now = {f.episode: f for f in firing}
        for episode, (start, first, last, clean) in list(self.active.items()):
            if not episode.startswith(scope):
                continue
            if episode in now:
                self.active[episode] = (start, first, now[episode], 0)
                continue
            if clean < last.cooldown or (episode not in self.silent and self._joined_open(episode)):
                self.active[episode] = (start, first, last, clean + 1)  # the event ends when all its parts do
                continue
            del self.active[episode]
            if episode in self.silent:
                self.silent.discard(episode)
                continue
            events.append(AlertEvent(first.rule, first.tag, "end", step, last.value, first.threshold,
                                     steps=step - start))
        for episode, f in now.items():
            if episode not in self.active:
                self.active[episode] = (step, f, f, 0)
                if any(_base(other) == _base(episode) for other in self.active if other != episode):
                    self.silent.add(episode)
                    continue
                events.append(AlertEvent(f.rule, f.tag, "start", step, f.value, f.threshold, also=f.also))
        return events

    def _joined_open(self, episode: str) -> bool:
        return any(other in self.silent and _base(other) == _base(episode) for other in self.active)

    def open_episodes(self) -> list[Firing]:
        """The first firing of every episode still open (a silent one is part of another)."""
        return [first for episode, (_, first, _, _) in self.active.items() if episode not in self.silent]

    def state_dict(self) -> dict[str, Any]:
        return {episode: {"start": start, "first": _firing(first), "last": _firing(last), "clean": clean,
                          **({"silent": True} if episode in self.silent else {})}
                for episode, (start, first, last, clean) in self.active.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.active = {episode: (int(v["start"]), Firing(**v["first"]), Firing(**v["last"]), int(v.get("clean", 0)))
                       for episode, v in state.items()}
        self.silent = {episode for episode, v in state.items() if v.get("silent") is True}


def _base(episode: str) -> str:
    """The episode without its scope (``pre:``/``post:``)."""
    scope, sep, rest = episode.partition(":")
    return rest if sep and scope in ("pre", "post") else episode


def _firing(f: Firing) -> dict[str, Any]:
    return {"rule": f.rule, "episode": f.episode, "tag": f.tag, "value": f.value, "threshold": f.threshold,
            "action": f.action, "also": list(f.also), "cooldown": f.cooldown}
