"""A GELU with a wrong low-precision implementation, and a small model that calls it.

`lossy_gelu` stands for a device kernel that computes in float16 internally: float64 inputs
(the pre-check's benchmark) get the exact GELU, every other dtype goes through float16. It takes
part in ``__torch_function__`` like torch's own functions, so the API capture sees one
``Functional.gelu`` call. `install()` puts it in place of ``torch.nn.functional.gelu``;
`sitecustomize_dir()` writes a ``sitecustomize.py`` that installs it in a child process.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function_unary

EXACT_GELU = torch._C._nn.gelu


def lossy_gelu(input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if has_torch_function_unary(input):
        return handle_torch_function(lossy_gelu, (input,), input, approximate=approximate)
    if input.dtype == torch.float64:
        return EXACT_GELU(input, approximate=approximate)
    return EXACT_GELU(input.half(), approximate=approximate).to(input.dtype)


def install() -> None:
    F.gelu = lossy_gelu


def uninstall() -> None:
    F.gelu = EXACT_GELU


def sitecustomize_dir(path: Path) -> Path:
    """A directory whose sitecustomize.py installs `lossy_gelu` (put it first on PYTHONPATH)."""
    path.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parent
    (path / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(here)!r})\nimport precheck_helpers\nprecheck_helpers.install()\n")
    return path


class GeluNet(nn.Module):
    """linear -> gelu -> layer_norm -> linear -> cross entropy: five API calls, one of them GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x) * 4)
        h = F.layer_norm(h, (64,))
        return F.cross_entropy(self.fc2(h), target)


def train_step_dump(dump_path: Path, task: str, seed: int = 0) -> Path:
    """One training step of `GeluNet` under the dump (L1); the rank directory written."""
    from msprobe_engine.dump import PrecisionDebugger

    torch.manual_seed(seed)
    model = GeluNet()
    x, target = torch.randn(8, 16), torch.randint(0, 8, (8,))
    debugger = PrecisionDebugger({"task": task, "dump_path": str(dump_path), "level": "L1"})
    debugger.start(model)
    model(x, target).backward()
    debugger.stop()
    debugger.step()
    debugger.close()
    return next(dump_path.glob("step0/*"))


def predecessor_dump(dump_path: Path, task: str) -> None:
    """One training step of `GeluNet` (lossy GELU) under the predecessor's own dump (mindstudio-probe,
    L1). It patches torch process-wide: run it in a child process."""
    import json

    from msprobe.pytorch import PrecisionDebugger as PredecessorDebugger

    config = dump_path.parent / "predecessor_config.json"
    config.write_text(json.dumps({"task": task, "dump_path": str(dump_path), "rank": [], "step": [], "level": "L1"}))
    install()
    torch.manual_seed(0)
    model = GeluNet()
    x, target = torch.randn(8, 16), torch.randint(0, 8, (8,))
    debugger = PredecessorDebugger(config_path=str(config))
    debugger.start(model)
    model(x, target).backward()
    debugger.stop()
    debugger.step()
