"""The monitor's saved state: a versioned dict of plain Python types (`torch.save`-able).

    {"version": 1, "step": 120, "rules": [{"rule": "spike", "state": {...}}, ...],
     "episodes": {...open alert episodes...}, "incidents": {"count": 2, ...}, "records_written": 120}

Where each integration saves it: docs/architecture.md ("State across a restart").
"""
from __future__ import annotations

from typing import Any

from msprobe_engine.errors import ConfigError

STATE_VERSION = 1


def check_state(state: Any, rules: list[str]) -> None:
    """Raise `ConfigError` when `state` is not a monitor state this config can resume from:
    another version, or rules that differ from the configured ones (in order)."""
    if not isinstance(state, dict) or "version" not in state:
        raise ConfigError(f"monitor state: expected the dict of Monitor.state_dict(), got {type(state).__name__}")
    if state["version"] != STATE_VERSION:
        raise ConfigError(f"monitor state: version {state['version']!r} is not supported (this release reads "
                          f"version {STATE_VERSION})")
    saved = [entry.get("rule") for entry in state.get("rules", [])]
    if saved != rules:
        raise ConfigError(f"monitor state: saved with the rules {saved}, but the config has {rules}; "
                          "resume with the config the state was saved with")
