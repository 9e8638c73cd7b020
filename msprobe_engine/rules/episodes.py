"""From per-step firings to alert episodes: one start and one end event each."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from msprobe_engine.records import AlertEvent
from msprobe_engine.rules.base import Firing
from msprobe_engine.rules.tags import Hit, grouped


@dataclass(slots=True)
class Episode:
    """An open episode: its first firing (what its start event said), the step it started on,
    the last value of its own tag (`first.tag`), the step it last fired on, the tags it fired
    on (an episode followed per tag; empty: every firing of its key belongs to it), the clean
    evaluations since its last firing and how many it waits for (`cooldown`), and, for one that
    joined an open episode of another scope (silent: no start or end event), that one's key."""
    first: Firing
    start: int
    value: float
    last_step: int
    tags: set[str] = field(default_factory=set)
    clean: int = 0
    cooldown: int = 0
    partner: str | None = None

    def fire(self, step: int, tag: str, value: float, cooldown: int) -> None:
        if tag == self.first.tag:
            self.value = value
        self.last_step, self.clean, self.cooldown = step, 0, cooldown


class AlertTracker:
    """Turns per-step firings into start/end events, one pair per episode.

    A firing that lists its hits (`Firing.parts`: spike, trend, the router rules) is followed
    per tag. A hit on a tag an open episode of its rule has fired on continues that episode;
    the step's other hits join an episode still firing (it fired on the last evaluation too: a
    growth spreading, experts dying one after the other). Without one, hits on new tags are a
    new event: a new episode with its own start event, named after the innermost module of the
    first new hit, that takes every hit of the step (a spike upstream shows downstream too). So
    an episode that waits out its cooldown absorbs no spike elsewhere, but its own tags firing
    again (and nothing new) continue it. A firing without parts (non_finite: a nan reaches
    everything after it) is one episode per `Firing.episode` key.

    `scope` separates evaluations of different parts of a step (e.g. what is known before the
    optimizer step and what only after it): an episode ends only when the scope that started it
    evaluates clean, `cooldown` times in a row after its last firing (the firing's own
    `cooldown`; 0: at once). The end event names the episode's tag and carries that tag's value
    on the last step it fired.

    An episode that starts in one scope on a step an episode of the same rule in another scope
    fired on (a nan in the activations, then, after the optimizer step, in the weights it
    reached) is part of that event: it is tracked, but it starts and ends silently, and the
    other one ends only when it has.
    """

    def __init__(self) -> None:
        #: key (the firing's episode, `@tag` for one followed per tag) -> its open episode
        self.active: dict[str, Episode] = {}

    def update(self, step: int, firing: list[Firing], scope: str = "") -> list[AlertEvent]:
        starts: list[AlertEvent] = []
        fired: set[str] = set()  # keys of the episodes that fired now
        for f in firing:
            f.episode = f"{scope}{f.episode}"
            if f.parts and f.episode not in self.active:  # (a whole-key episode: saved before parts)
                self._by_tag(step, f, fired, starts)
                continue
            episode = self.active.get(f.episode)
            if episode is None:
                self._start(step, f.episode, f, set(), fired, starts)
            else:
                episode.fire(step, f.tag, f.value, f.cooldown)
                fired.add(f.episode)
        ends = []
        for key, episode in list(self.active.items()):
            if key in fired or not episode.first.episode.startswith(scope):
                continue
            if episode.clean < episode.cooldown or any(other.partner == key for other in self.active.values()):
                episode.clean += 1  # the event ends when all its parts do
                continue
            del self.active[key]
            if episode.partner is None:
                first = episode.first
                ends.append(AlertEvent(first.rule, first.tag, "end", step, episode.value, first.threshold,
                                       steps=step - episode.start))
        return ends + starts

    def _by_tag(self, step: int, f: Firing, fired: set[str], starts: list[AlertEvent]) -> None:
        """Hand each of `f`'s parts to the open episode of its tag, the others to an episode still
        firing (it fired on the last evaluation); without one, the step is a new event."""
        owners = {tag: key for key, episode in self.active.items() if episode.first.episode == f.episode
                  for tag in episode.tags}  # (a tag of several: the newest episode's)
        fresh = [part for part in f.parts if part[0] not in owners]
        live = next((owners[tag] for tag, _, _ in f.parts if tag in owners and self.active[owners[tag]].clean == 0),
                    None)
        if fresh and live is None:  # a new event: what fires with it on this step is part of it
            hits = fresh + [part for part in f.parts if part[0] in owners]
            first = grouped(hits, f.rule, f.episode, f.action, f.cooldown)
            self._start(step, f"{f.episode}@{step}:{first.tag}", first, {tag for tag, _, _ in hits}, fired, starts)
            return
        for tag, value, _ in f.parts:
            key = owners.get(tag, live)
            episode = self.active[key]
            episode.tags.add(tag)
            episode.fire(step, tag, value, f.cooldown)
            fired.add(key)

    def _start(self, step: int, key: str, first: Firing, tags: set[str], fired: set[str],
               starts: list[AlertEvent]) -> None:
        base = _base(first.episode)
        partner = next((other for other, episode in self.active.items()
                        if episode.partner is None and episode.first.episode != first.episode
                        and _base(episode.first.episode) == base and episode.last_step >= step), None)
        self.active[key] = Episode(first, step, first.value, step, tags, cooldown=first.cooldown, partner=partner)
        fired.add(key)
        if partner is None:
            starts.append(AlertEvent(first.rule, first.tag, "start", step, first.value, first.threshold,
                                     also=first.also))

    def open_episodes(self) -> list[Firing]:
        """The first firing of every episode still open (a silent one is part of another)."""
        return [episode.first for episode in self.active.values() if episode.partner is None]

    def state_dict(self) -> dict[str, Any]:
        return {key: {"start": e.start, "first": _firing(e.first), "value": e.value, "last_step": e.last_step,
                      "tags": sorted(e.tags), "clean": e.clean, "cooldown": e.cooldown,
                      **({"partner": e.partner} if e.partner is not None else {})}
                for key, e in self.active.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.active = {}
        for key, v in state.items():
            first = _load_firing(v["first"])
            last = _load_firing(v["last"]) if "last" in v else first  # "last", "silent": saved before per-tag episodes
            value = float(v["value"]) if "value" in v else (last.value if last.tag == first.tag else first.value)
            partner = v.get("partner", "" if v.get("silent") is True else None)
            self.active[str(key)] = Episode(first, int(v["start"]), value, int(v.get("last_step", v["start"])),
                                            {str(tag) for tag in v.get("tags", ())}, int(v.get("clean", 0)),
                                            int(v.get("cooldown", last.cooldown)),
                                            None if partner is None else str(partner))


def _base(episode: str) -> str:
    """The episode without its scope (``pre:``/``post:``)."""
    scope, sep, rest = episode.partition(":")
    return rest if sep and scope in ("pre", "post") else episode


def _firing(f: Firing) -> dict[str, Any]:
    return {"rule": f.rule, "episode": f.episode, "tag": f.tag, "value": f.value, "threshold": f.threshold,
            "action": f.action, "also": list(f.also), "cooldown": f.cooldown,
            "parts": [list(part) for part in f.parts]}


def _load_firing(saved: dict[str, Any]) -> Firing:
    return Firing(**{**saved, "also": tuple(saved.get("also", ())),
                     "parts": tuple((str(t), float(v), None if h is None else float(h))
                                    for t, v, h in saved.get("parts", ()))})
