"""The monitor's typed configuration: one dataclass per section.

Every field has a type, a default and (where it is a choice) the allowed
values in ``metadata["choices"]``; `msprobe_engine.config.loader` validates a
plain dict against these classes and names the key path of anything wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from msprobe_engine.fields import above, at_least, between, choices, pattern, registered
from msprobe_engine.rules import RULES, Rule
from msprobe_engine.sinks import SINKS, Sink
from msprobe_engine.stats import DEFAULT_STATS, STATISTICS

OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq", "update", "ratio")
REPLAY_LEVELS = ("L0", "mix")


@dataclass(kw_only=True, slots=True)
class Schedule:
    """Which optimizer steps are monitored: start <= step < end, every `interval`."""
    start_step: int = field(default=0, metadata=at_least(0))
    end_step: Optional[int] = field(default=None, metadata={**at_least(0), **above("start_step")})
    interval: int = field(default=1, metadata=at_least(1))

    def is_monitored(self, step: int) -> bool:
        if step < self.start_step or (self.end_step is not None and step >= self.end_step):
            return False
        return (step - self.start_step) % self.interval == 0


@dataclass(kw_only=True, slots=True)
class ModelHealth:
    """Model-health signals, all off by default (docs/model_health.md): attention entropy and
    largest probability, stable rank of 2-D weights every `stable_rank_every` monitored steps
    (0: never; `stable_rank_iterations` power iterations per step), the sign agreement of
    gradient and momentum (the predecessor's mg_direction), the gradient norm per micro-batch, the
    training's collectives per step (calls and bytes per op kind)."""
    attention_entropy: bool = False
    stable_rank_every: int = field(default=0, metadata=at_least(0))
    stable_rank_iterations: int = field(default=2, metadata=between(1, 100))
    mg_direction: bool = False
    micro_batch_grads: bool = False
    collectives: bool = False


@dataclass(kw_only=True, slots=True)
class Watch:
    """What is measured on a monitored step."""
    module_outputs: bool = True
    module_inputs: bool = False
    activation_grads: bool = False
    param_grads: bool = True
    params: bool = False
    optimizer_state: list[str] = field(
        default_factory=lambda: ["exp_avg", "exp_avg_sq"], metadata=choices(*OPTIMIZER_STATES))
    #: mixture-of-experts routers' health (`router/` tags: load per expert, imbalance, entropy)
    routers: bool = True
    #: model-health signals (`health/` tags, `optim/<param>/mg_direction`, `comm/` tags)
    health: ModelHealth = field(default_factory=ModelHealth)


@dataclass(kw_only=True, slots=True)
class ModuleSelection:
    """Modules whose activations are watched; all of them when every list is empty."""
    names: list[str] = field(default_factory=list)
    regex: list[str] = field(default_factory=list, metadata=pattern())
    types: list[str] = field(default_factory=list)
    exclude_regex: list[str] = field(default_factory=list, metadata=pattern())


@dataclass(kw_only=True, slots=True)
class Writer:
    """The background writer's bounded queue."""
    queue_size: int = field(default=256, metadata=at_least(1))
    when_full: str = field(default="drop", metadata=choices("drop", "wait"))


@dataclass(kw_only=True, slots=True)
class Replay:
    """Re-run of a step whose anomaly was found before the optimizer step, with a tensor dump
    (`level` L0: modules; mix: modules and APIs) into the incident directory. Only steps run
    through `Monitor.run_step` (or a `Monitor.replayable` function) can be replayed."""
    enabled: bool = True
    level: str = field(default="L0", metadata=choices(*REPLAY_LEVELS))


@dataclass(kw_only=True, slots=True)
class Incidents:
    """What an alert leaves on disk: one directory per alert episode that starts, at most
    `max_incidents` per run, under `dir` (default `<output_dir>/incidents`); `top_k` modules
    by deviation from their running average are named in it."""
    enabled: bool = True
    dir: str = field(default="", metadata={"path": True})
    max_incidents: int = field(default=10, metadata=at_least(0))
    top_k: int = field(default=10, metadata=at_least(0))
    replay: Replay = field(default_factory=Replay)


@dataclass(kw_only=True, slots=True)
class ControlSettings:
    """The live control file (docs/control.md): `file` (default `<output_dir>/control.json`),
    looked at every `interval_s` seconds at most, from the writer thread."""
    enabled: bool = True
    file: str = field(default="", metadata={"path": True})
    interval_s: float = field(default=5.0, metadata=between(0.0, 86400.0))


def default_rules() -> list[Rule.Config]:
    """non_finite on every kind, spike on the loss and the global gradient norm."""
    return [RULES.get(name).Config(rule=name) for name in ("non_finite", "spike")]


def default_sinks() -> list[Sink.Config]:
    return [SINKS.get(name).Config(name=name) for name in ("tensorboard", "jsonl")]


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    """The whole monitor configuration (see README, "Configuration")."""
    #: modules imported before the config is validated (they register statistics, rules, sinks)
    plugins: list[str] = field(default_factory=list)
    output_dir: str = field(default="./msprobe_output", metadata={"path": True})
    run_name: str = field(default="", metadata={"path": True})  # <output_dir>/<run_name>/rank<R>/; empty: $MSPROBE_RUN_NAME, else a timestamp (run_dir.py)
    resume: bool = False  # continue the run in a directory that holds one, instead of refusing it
    strict: bool = False
    schedule: Schedule = field(default_factory=Schedule)
    watch: Watch = field(default_factory=Watch)
    modules: ModuleSelection = field(default_factory=ModuleSelection)
    stats: list[str] = field(default_factory=lambda: list(DEFAULT_STATS), metadata={"choices": STATISTICS})
    sinks: list[Sink.Config] = field(default_factory=default_sinks, metadata=registered(SINKS, "name", shorthand=True))
    writer: Writer = field(default_factory=Writer)
    ring_buffer: int = field(default=32, metadata=at_least(1))
    per_rank: bool = False
    alerts: list[Rule.Config] = field(default_factory=default_rules, metadata=registered(RULES, "rule"))
    incidents: Incidents = field(default_factory=Incidents)
    control: ControlSettings = field(default_factory=ControlSettings)
