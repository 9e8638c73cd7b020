"""Accept the predecessor's monitor config spelling (msprobe `monitor` JSON).

`translate_legacy` rewrites the predecessor's keys into ours; the table in
README ("Predecessor keys") documents the same mapping. Mixing a legacy key
with the key it maps to is an error, so no setting is silently overridden.
"""
from __future__ import annotations

import copy
from typing import Any

from msprobe_engine.config.errors import ConfigError

#: predecessor op name -> our statistic name
LEGACY_OPS = {"min": "min", "max": "max", "mean": "mean", "norm": "norm",
              "nans": "nan_count", "zeros": "zero_frac"}
#: predecessor rule name -> factor derived from its threshold
LEGACY_RULES = ("AnomalyTurbulence",)

LEGACY_KEYS = ("targets", "all_xy", "xy_distribution", "forward_only", "backward_only",
               "wg_distribution", "param_distribution", "mv_distribution", "ur_distribution",
               "ops", "format", "start_step", "step_interval", "collect_times", "alert")


def translate_legacy(data: dict) -> dict:
    """Return a copy of `data` with predecessor keys rewritten into ours."""
    if not any(key in data for key in LEGACY_KEYS):
        return data
    out = copy.deepcopy({k: v for k, v in data.items() if k not in LEGACY_KEYS})

    def put(section: str | None, key: str, value: Any, legacy: str) -> None:
        target = out.setdefault(section, {}) if section else out
        if not isinstance(target, dict):
            raise ConfigError(f"{section}: expected a mapping")
        if key in target:
            where = f"{section}.{key}" if section else key
            raise ConfigError(f"{legacy}: the predecessor key and '{where}' are both set; keep one")
        target[key] = value

    if "targets" in data:
        targets = data["targets"]
        if not isinstance(targets, (dict, list)):
            raise ConfigError(f"targets: expected a mapping or list of module names, got {targets!r}")
        if not data.get("all_xy"):
            put("modules", "names", list(targets), "targets")
    if "xy_distribution" in data:
        on = data["xy_distribution"]
        put("watch", "module_outputs", bool(on) and not data.get("backward_only"), "xy_distribution")
        put("watch", "activation_grads", bool(on) and not data.get("forward_only"), "xy_distribution")
    for legacy, ours in (("wg_distribution", "param_grads"), ("param_distribution", "params")):
        if legacy in data:
            put("watch", ours, data[legacy], legacy)
    states: list[str] = []
    if data.get("mv_distribution"):
        states += ["exp_avg", "exp_avg_sq"]
    if data.get("ur_distribution"):
        states += ["update", "ratio"]
    if "mv_distribution" in data or "ur_distribution" in data:
        put("watch", "optimizer_state", states, "mv_distribution")
    if "ops" in data:
        put(None, "stats", [_legacy_op(op, i) for i, op in enumerate(data["ops"])], "ops")
    if "format" in data:
        put(None, "sinks", [_legacy_format(data["format"])], "format")
    _translate_schedule(data, put)
    if "alert" in data:
        put(None, "alerts", _legacy_alerts(data["alert"]), "alert")
    return out


def _legacy_op(op: Any, index: int) -> Any:
    if op in LEGACY_OPS:
        return LEGACY_OPS[op]
    raise ConfigError(f"ops[{index}]: {op!r} is not one of {', '.join(LEGACY_OPS)}")


def _legacy_format(fmt: Any) -> Any:
    if fmt in ("tensorboard", "csv"):
        return fmt
    raise ConfigError(f"format: {fmt!r} is not one of tensorboard, csv (use 'sinks' for jsonl)")


def _translate_schedule(data: dict, put) -> None:
    if "start_step" in data:
        put("schedule", "start_step", data["start_step"], "start_step")
    if "step_interval" in data:
        put("schedule", "interval", data["step_interval"], "step_interval")
    times = data.get("collect_times")
    if isinstance(times, (int, float)) and not isinstance(times, bool) and times < 1e8:
        start = data.get("start_step", 0)
        interval = data.get("step_interval", 1)
        if isinstance(start, int) and isinstance(interval, int):
            put("schedule", "end_step", start + int(times) * interval, "collect_times")


def _legacy_alerts(alert: Any) -> list[dict]:
    if not isinstance(alert, dict):
        raise ConfigError(f"alert: expected a mapping, got {alert!r}")
    rules: list[dict] = [{"rule": "non_finite"}]
    for i, rule in enumerate(alert.get("rules", [])):
        name = rule.get("rule_name") if isinstance(rule, dict) else None
        if name not in LEGACY_RULES:
            raise ConfigError(f"alert.rules[{i}].rule_name: {name!r} is not one of {', '.join(LEGACY_RULES)}")
        threshold = rule.get("args", {}).get("threshold", 0.5)
        rules.append({"rule": "spike", "metrics": ["*"], "factor": 1.0 + float(threshold)})
    return rules
