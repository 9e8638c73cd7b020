"""An incident as markdown for TensorBoard's text plugin, from its incident.json."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

INCIDENT_JSON = "incident.json"


def incident_directory(root: Path, step: int, rank: int, rule: str) -> Path:
    """Where the incident recorder puts the incident of `rule` starting at `step`."""
    return root / f"step{step}-rank{rank}-{rule}"


def read_incident(directory: Path) -> dict[str, Any] | None:
    """incident.json of `directory`, or None while it is not written (it is written last)."""
    try:
        return json.loads((directory / INCIDENT_JSON).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def incident_markdown(report: dict[str, Any], directory: Path) -> str:
    """Rule, step, the first tensor, culprit (class, phase), action, replay, directory, and
    the top deviations as a table."""
    culprit = report.get("culprit") or {}
    if culprit.get("call"):
        blamed = (f"`{culprit['call']}` ({culprit.get('module_class')}, {culprit.get('phase')}): "
                  f"{culprit.get('method', '')}")
    else:
        blamed = f"none among the watched modules; first bad row `{culprit.get('first_bad')}`"
    replay = report.get("replay") or {}
    rows = [("rule", report.get("rule")), ("step", report.get("step")), ("rank", report.get("rank")),
            ("first tensor", f"`{report.get('tensor')}` = {_number(report.get('value'))}"),
            ("culprit", blamed), ("action", report.get("action")),
            ("replay", f"{replay.get('status', 'not recorded')}: {replay.get('detail', '')}"),
            ("directory", f"`{directory.resolve()}`")]
    lines = [f"### {report.get('rule')} at step {report.get('step')}", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows]
    deviations = report.get("top_deviations") or []
    if deviations:
        lines += ["", "Top deviations from the running average:", "",
                  "| row | norm | deviation (fold) |", "|---|---|---|"]
        lines += [f"| `{d['row']}` | {_number(d['norm'])} | {_number(d['deviation'])} |" for d in deviations]
    return "\n".join(lines)


def _number(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value) if not math.isfinite(value) else f"{value:.6g}"
    return str(value)
