"""Accept the predecessor's monitor config spelling (msprobe `monitor` JSON, mindstudio-probe 26.2).

`translate_legacy` rewrites the predecessor's keys into ours; docs/predecessor.md
documents the same mapping. Mixing a legacy key with the key it maps to is an
error, so no setting is silently overridden. Its keys for what is not measured
here (`NOT_MEASURED`) load: at their default value silently, otherwise with one
warning saying so and what to use instead.
"""
from __future__ import annotations

import copy
import logging
from typing import Any

from msprobe_engine.errors import ConfigError

log = logging.getLogger("msprobe_engine")

#: predecessor op name -> our statistic name
LEGACY_OPS = {"min": "min", "max": "max", "mean": "mean", "norm": "norm",
              "nans": "nan_count", "zeros": "zero_frac"}
#: its ops that are tensor metadata, not statistics: accepted, not measured
NOT_MEASURED_OPS = {"id": "tags name every tensor", "shape": "dumps record shapes",
                    "dtype": "dumps record dtypes"}
#: predecessor rule names (alert.rules[].rule_name)
LEGACY_RULES = ("AnomalyTurbulence", "AnomalyNan")
#: its keys of model-health signals -> ours in watch.health
HEALTH_KEYS = {"mg_direction": "mg_direction", "monitor_mbs_grad": "micro_batch_grads"}
#: its `cc_distribution` sub-keys and their defaults: `enable` -> watch.health.collectives (calls and
#: bytes per op kind, not its statistics of the collectives' tensors); the others are not applied here
CC_DISTRIBUTION = {"enable": False, "cc_codeline": [], "cc_pre_hook": False, "cc_log_only": False}
#: its keys for what is not measured here: (default value, what to use instead)
NOT_MEASURED: dict[str, tuple[Any, str]] = {
    "stack_info": (False, "the dump writes stack.json"),
    "print_struct": (False, "module paths are the tags' <path> part"),
    "recording_l2_features": (False, "use watch.module_inputs / module_outputs"),
    "l2_targets": ({}, "use modules.names"),
    "append_output": ([], "runs append to output_dir by their own directory"),
    "squash_name": (False, "tags keep the full module path"),
    "sa_order": ("s,b,h,d", "attention layouts are not split here"),
    "eps": (1e-8, "statistics need no epsilon here"),
    "ndigits": (6, "values are written at full precision"),
    "step_count_per_record": (1, "every monitored step is one record"),
    "dynamic_on": (False, "change the schedule in the config"),
}

LEGACY_KEYS = ("targets", "all_xy", "xy_distribution", "forward_only", "backward_only",
               "wg_distribution", "param_distribution", "mv_distribution", "ur_distribution",
               "ops", "format", "start_step", "step_interval", "collect_times", "alert",
               "module_ranks", "cc_distribution", *HEALTH_KEYS, *NOT_MEASURED)


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
    for legacy, names in (("mv_distribution", ["exp_avg", "exp_avg_sq"]), ("ur_distribution", ["update", "ratio"])):
        if legacy in data and not isinstance(data[legacy], bool):
            raise ConfigError(f"{legacy}: expected true or false, got {_show(data[legacy])}")
        if data.get(legacy):
            states += names
    given = [key for key in ("mv_distribution", "ur_distribution") if key in data]
    if given:
        put("watch", "optimizer_state", states, " and ".join(given))
    for legacy in HEALTH_KEYS:
        if legacy in data and not isinstance(data[legacy], bool):
            raise ConfigError(f"{legacy}: expected true or false, got {_show(data[legacy])}")
    given = [key for key in HEALTH_KEYS if key in data]
    health = {HEALTH_KEYS[key]: data[key] for key in given}
    if "cc_distribution" in data:
        health["collectives"] = _legacy_collectives(data["cc_distribution"])
        given.append("cc_distribution")
    if given:
        put("watch", "health", health, " and ".join(given))
    if "ops" in data:
        put(None, "stats", _legacy_ops(data["ops"]), "ops")
    if "format" in data:
        put(None, "sinks", [_legacy_format(data["format"])], "format")
    _translate_schedule(data, put)
    if "alert" in data:
        put(None, "alerts", _legacy_alerts(data["alert"]), "alert")
        if isinstance(data["alert"], dict) and "dump" in data["alert"]:
            put("incidents", "enabled", data["alert"]["dump"], "alert.dump")
    if data.get("module_ranks"):
        raise ConfigError(f"module_ranks: {data['module_ranks']!r} is not supported here; rank 0 writes, "
                          "or every rank with per_rank: true")
    for key, (default, instead) in NOT_MEASURED.items():
        value = data.get(key, default)
        if value != default and not (isinstance(value, dict) and value.get("enable") is False):
            log.warning("msprobe monitor: predecessor key %s=%r is accepted but not measured here: %s",
                        key, data[key], instead)
    return out


def _legacy_ops(ops: Any) -> list[str]:
    if not isinstance(ops, list):
        raise ConfigError(f"ops: expected a list, got {ops!r}")
    stats = []
    for index, op in enumerate(ops):
        if op in NOT_MEASURED_OPS:
            log.warning("msprobe monitor: predecessor op %r is accepted but not a statistic here (%s)",
                        op, NOT_MEASURED_OPS[op])
        elif op in LEGACY_OPS:
            stats.append(LEGACY_OPS[op])
        else:
            raise ConfigError(f"ops[{index}]: {op!r} is not one of {', '.join([*LEGACY_OPS, *NOT_MEASURED_OPS])}")
    return stats


def _legacy_collectives(cc: Any) -> bool:
    """`cc_distribution` -> watch.health.collectives (its `enable`); its other sub-keys warn when set."""
    if not isinstance(cc, dict):
        raise ConfigError(f"cc_distribution: expected a mapping, got {_show(cc)}")
    for key, value in cc.items():
        if key not in CC_DISTRIBUTION:
            raise ConfigError(f"cc_distribution.{key}: not one of {', '.join(CC_DISTRIBUTION)}")
        if key == "enable" and not isinstance(value, bool):
            raise ConfigError(f"cc_distribution.enable: expected true or false, got {_show(value)}")
        if key != "enable" and value != CC_DISTRIBUTION[key]:
            log.warning("msprobe monitor: predecessor key cc_distribution.%s=%r is accepted but not applied here: "
                        "the monitor counts the calls and bytes of every collective per op kind "
                        "(watch.health.collectives)", key, value)
    return cc.get("enable", False)


def _legacy_format(fmt: Any) -> Any:
    if fmt in ("tensorboard", "csv"):
        return fmt
    raise ConfigError(f"format: {fmt!r} is not one of tensorboard, csv (use 'sinks' for jsonl)")


def _translate_schedule(data: dict, put) -> None:
    if "start_step" in data:
        put("schedule", "start_step", data["start_step"], "start_step")
    if "step_interval" in data:
        put("schedule", "interval", data["step_interval"], "step_interval")
    if "collect_times" not in data:
        return
    times = data["collect_times"]
    whole = isinstance(times, int) or (isinstance(times, float) and times.is_integer())
    if isinstance(times, bool) or not whole or not times >= 1:
        raise ConfigError(f"collect_times: expected a whole number of steps, at least 1, got {_show(times)}")
    if times < 1e8:  # the predecessor's default (1e8) and beyond: no end step
        start = data.get("start_step", 0)
        interval = data.get("step_interval", 1)
        if isinstance(start, int) and isinstance(interval, int):
            put("schedule", "end_step", start + int(times) * interval, "collect_times")


def _show(value: Any) -> str:
    text = repr(value)
    return (text if len(text) <= 80 else text[:77] + "...") + f" ({type(value).__name__})"


def _legacy_alerts(alert: Any) -> list[dict]:
    if not isinstance(alert, dict):
        raise ConfigError(f"alert: expected a mapping, got {alert!r}")
    rules: list[dict] = [{"rule": "non_finite"}]
    for i, rule in enumerate(alert.get("rules", [])):
        name = rule.get("rule_name") if isinstance(rule, dict) else None
        if name not in LEGACY_RULES:
            raise ConfigError(f"alert.rules[{i}].rule_name: {name!r} is not one of {', '.join(LEGACY_RULES)}")
        args = rule.get("args") or {}
        if not isinstance(args, dict):
            raise ConfigError(f"alert.rules[{i}].args: expected a mapping, got {args!r}")
        if name == "AnomalyNan":  # nan (always watched: non_finite), optionally |value| > threshold
            if args.get("threshold") is not None:
                log.warning("msprobe monitor: AnomalyNan's threshold %r is not supported here (no absolute "
                            "limits); nan/inf are watched by the non_finite rule, use a spike rule for "
                            "jumps", args["threshold"])
            continue
        threshold = args.get("threshold", 0.5)
        rules.append({"rule": "spike", "metrics": ["*"], "factor": 1.0 + float(threshold)})
    return rules
