"""A drop-in for the predecessor's PyTorch API: change one import line.

::

    # from msprobe.pytorch import PrecisionDebugger, TrainerMon, seed_all, module_dump, module_dump_end
    from msprobe_engine.compat import PrecisionDebugger, TrainerMon, seed_all, module_dump, module_dump_end

The rest of a script written for mindstudio-probe runs unchanged: the same config.json and
monitor JSON, the same calls and arguments, the same dump layout and names (docs/predecessor.md).
Names load on first use, so importing this package imports no framework. The MindSpore
drop-in is `msprobe_engine.compat.mindspore` (``from msprobe.mindspore import ...``).
"""
from __future__ import annotations

import importlib

#: exported name -> the module that defines it
_EXPORTS = {
    "PrecisionDebugger": "msprobe_engine.compat.debugger",
    "module_dump": "msprobe_engine.compat.debugger",
    "module_dump_end": "msprobe_engine.compat.debugger",
    "TrainerMon": "msprobe_engine.compat.trainer_mon",
    "seed_all": "msprobe_engine.frameworks.torch.seed",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
