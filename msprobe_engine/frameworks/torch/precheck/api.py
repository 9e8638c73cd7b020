"""What the framework-neutral pre-check calls on the torch side."""
from msprobe_engine.frameworks.torch.precheck.online import decode_case, encode_case
from msprobe_engine.frameworks.torch.precheck.replay import replay
from msprobe_engine.frameworks.torch.precheck.repro import repro_script

__all__ = ["decode_case", "encode_case", "replay", "repro_script"]
