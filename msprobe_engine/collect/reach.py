"""Which alert rules can fire on a given model: the tags a config would produce for it.

`model_tags` lists the tags the monitor could write for a model under a config, from the
model's module paths and parameter names alone (no forward pass; a module's output is
assumed to be one tensor or a tuple of them). `unreachable_rules` names each rule whose
`metrics` patterns match none of them (e.g. `train/los`, or activation norms while
`watch.module_outputs` is off). Framework-neutral: it reads `named_modules` /
`named_parameters` (torch) or `cells_and_names` / `parameters_and_names` (MindSpore).
"""
from __future__ import annotations

from typing import Any

from msprobe_engine.collect.selection import ModuleFilter
from msprobe_engine.config.schema import MonitorConfig
from msprobe_engine.rules.tags import TagMatcher


def _modules(model: Any) -> list[tuple[str, str]]:
    pairs = model.named_modules() if hasattr(model, "named_modules") else model.cells_and_names()
    return [(name, type(module).__name__) for name, module in pairs if name]


def _parameters(model: Any) -> list[str]:
    pairs = model.named_parameters() if hasattr(model, "named_parameters") else model.parameters_and_names()
    return [name for name, _ in pairs]


def model_tags(config: MonitorConfig, model: Any) -> set[str]:
    """Every tag the monitor could write for `model` under `config` (roles `output`, `output.0`,
    `input.0`)."""
    watch, stats = config.watch, config.stats
    wanted = ModuleFilter(config.modules)
    rows: list[tuple[str, str, str]] = []
    for path, class_name in _modules(model):
        if not wanted(path, class_name):
            continue
        if watch.module_outputs:
            rows += [("actv", path, "output"), ("actv", path, "output.0")]
        if watch.module_inputs:
            rows.append(("actv", path, "input.0"))
        if watch.activation_grads:
            rows += [("actv_grad", path, "output"), ("actv_grad", path, "output.0")]
    params = _parameters(model)
    if watch.param_grads:
        rows += [("grad", name, "") for name in params]
    if watch.params:
        rows += [("param", name, "") for name in params]
    rows += [("optim", name, state) for name in params for state in watch.optimizer_state if state != "ratio"]
    tags = {f"{kind}/{path}/{role}/{stat}" if role else f"{kind}/{path}/{stat}"
            for kind, path, role in rows for stat in stats}
    tags.add("train/loss")
    if watch.param_grads and params:
        tags.add("grad/global/norm")
    if "ratio" in watch.optimizer_state:
        tags |= {f"optim/{name}/ratio" for name in params}
    return tags


def unreachable_rules(config: MonitorConfig, model: Any) -> list[str]:
    """One warning per rule whose `metrics` match no tag of `model`."""
    tags = model_tags(config, model)
    warnings = []
    for i, rule in enumerate(config.alerts):
        patterns = getattr(rule, "metrics", None)
        if patterns is None:
            continue
        matcher = TagMatcher(patterns)
        if not any(matcher(tag) for tag in tags):
            warnings.append(f"alerts[{i}] ({rule.rule}): metrics {', '.join(map(repr, patterns))} match no tag of "
                            f"this model under this config; the rule can never fire")
    return warnings
