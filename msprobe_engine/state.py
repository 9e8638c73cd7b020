"""The monitor's saved state: a versioned dict of plain Python types (`torch.save`-able).

    {"version": 1, "step": 120, "rules": [{"rule": "spike", "state": {...}}, ...],
     "episodes": {...open alert episodes...}, "incidents": {"count": 2, ...}, "records_written": 120,
     "alerts_started": 3}

(`alerts_started`, the count behind Health/alerts, is absent from states saved before it: 0.)

Where each integration saves it: docs/architecture.md ("State across a restart").
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from msprobe_engine.errors import ConfigError

STATE_VERSION = 1


#: a saved step or count beyond this is not one a run reached (and not exactly a float64)
COUNT_LIMIT = 2 ** 53


def check_state(state: Any, rules: list[str]) -> None:
    """Raise `ConfigError` naming the field when `state` is not a monitor state this config can
    resume from: another version, a field of the wrong type (a step that is not an integer
    from 0, a rule entry without its state...), or rules that differ from the configured ones."""
    if not isinstance(state, dict) or "version" not in state:
        raise ConfigError(f"monitor state: expected the dict of Monitor.state_dict(), got {type(state).__name__}")
    if state["version"] != STATE_VERSION:
        raise ConfigError(f"monitor state: version {str(state['version'])[:40]} is not supported (this release reads "
                          f"version {STATE_VERSION})")
    for key in ("step", "records_written", "alerts_started"):
        value = state.get(key, 0)
        if key == "step" and "step" not in state:
            raise ConfigError("monitor state: step: missing")
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= COUNT_LIMIT:
            raise ConfigError(f"monitor state: {key}: expected an integer from 0 to {COUNT_LIMIT}, got {_show(value)}")
    entries = state.get("rules", [])
    if not isinstance(entries, list):
        raise ConfigError(f"monitor state: rules: expected a list, got {_show(entries)}")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("rule"), str) \
                or not isinstance(entry.get("state", {}), dict):
            raise ConfigError(f"monitor state: rules[{i}]: expected {{'rule': name, 'state': {{...}}}}, got {_show(entry)}")
    for key, kinds in (("episodes", (dict,)), ("incidents", (dict, type(None)))):
        if key not in state and key == "episodes":
            raise ConfigError("monitor state: episodes: missing")
        if not isinstance(state.get(key), kinds):
            raise ConfigError(f"monitor state: {key}: expected an object, got {_show(state.get(key))}")
    saved = [entry["rule"] for entry in entries]
    if saved != rules:
        raise ConfigError(f"monitor state: saved with the rules {saved}, but the config has {rules}; "
                          "resume with the config the state was saved with")


def restore(parts: list[tuple[str, Callable[[], None]]]) -> None:
    """Run each part's loader; one that fails on what it was given (a string for a running
    average, a malformed episode) is a `ConfigError` naming its field."""
    for name, load in parts:
        try:
            load()
        except ConfigError:
            raise
        except Exception as exc:  # whatever a component's load_state_dict raises on foreign content
            raise ConfigError(f"monitor state: {name}: cannot be restored: {type(exc).__name__}: "
                              f"{str(exc)[:200]}") from None


def _show(value: Any) -> str:
    text = repr(value)
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(value).__name__})"
