"""`PrecisionDebugger`: one name for the dump session of either framework.

``PrecisionDebugger(config, model=None, framework=None, **overrides)`` builds the session of
the framework named by `framework` (``"pytorch"``/``"torch"`` or ``"mindspore"``), else by the
config's ``framework`` key, else by `model` (a ``torch.nn.Module`` or a MindSpore ``Cell``),
else PyTorch's when torch can be imported, else MindSpore's. What it returns is that
framework's session (a `dump.session.DumpSession`): PyTorch's
`frameworks.torch.capture.session.PrecisionDebugger` or
`frameworks.mindspore.capture.session.MindSporePrecisionDebugger`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from msprobe_engine.errors import ConfigError
from msprobe_engine.config.loader import read_file
from msprobe_engine.registry import framework_of, load_framework

#: the config's ``framework`` spelling -> the registered framework
FRAMEWORK_NAMES = {"pytorch": "torch", "torch": "torch", "mindspore": "mindspore"}


class PrecisionDebugger:
    """The dump session of the run's framework; see the module docstring."""

    def __new__(cls, config: Any = None, *, config_path: str | Path | None = None, model: Any = None,
                framework: str | None = None, **overrides: Any) -> Any:
        name = session_framework(config if config is not None else config_path, model, framework)
        session = load_framework(name).dump_session()
        return session(config, config_path=config_path, model=model, **overrides)


def session_framework(config: Any, model: Any = None, framework: str | None = None) -> str:
    """The registered framework ('torch' or 'mindspore') whose dump session serves this run."""
    named = framework
    if named is None and isinstance(config, dict):
        named = config.get("framework")
    elif named is None and isinstance(config, (str, Path)):
        named = read_file(Path(config)).get("framework")
    if named is not None:
        if named not in FRAMEWORK_NAMES:
            raise ConfigError(f"framework: {named!r} is not supported; use one of pytorch, mindspore")
        return FRAMEWORK_NAMES[named]
    found = framework_of(model) if model is not None else None
    if found is not None:
        return found
    return "torch" if importlib.util.find_spec("torch") is not None else "mindspore"
