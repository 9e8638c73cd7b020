"""What happens on an anomaly: incidents (culprit, evidence, replay) and actions (skip, stop)."""
from msprobe_engine.incident.actions import StepDecision, TrainingStopped
from msprobe_engine.incident.culprit import Culprit, first_culprit
from msprobe_engine.incident.recorder import Incident, IncidentRecorder
from msprobe_engine.incident.replay import ReplayResult
from msprobe_engine.incident.writer import INCIDENT_JSON

__all__ = ["Culprit", "INCIDENT_JSON", "Incident", "IncidentRecorder", "ReplayResult", "StepDecision",
           "TrainingStopped", "first_culprit"]
