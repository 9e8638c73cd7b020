"""Dumps of a small model for the graph tests: two residual blocks (fc, relu, scale) and a head.

`gain` scales the output of ``blocks.1.scale`` (a module of its own, so that it is a node):
a dump with gain 3 against one with gain 1 diverges first in that layer.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from msprobe_engine.dump import PrecisionDebugger

PERTURBED = "Module.blocks.1.scale.Scale.forward.0"


class Scale(nn.Module):
    def __init__(self, gain: float = 1.0) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Block(nn.Module):
    def __init__(self, gain: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.scale = Scale(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.act(self.fc(x))) + x


class Net(nn.Module):
    def __init__(self, blocks: int = 2, gain: float = 1.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(gain if i == 1 else 1.0) for i in range(blocks))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def train(model: nn.Module, steps: int, start, stop, step) -> None:
    """`steps` forward/backward/SGD steps on fixed random data, under the given dump calls."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(steps, 4, 8, generator=torch.Generator().manual_seed(1))
    for x in data:
        start(model)
        model(x).backward()
        stop()
        opt.step()
        opt.zero_grad()
        step()


def dump(root: Path, level: str = "L0", *, gain: float = 1.0, blocks: int = 2, steps: int = 1,
         task: str = "statistics") -> Path:
    """Dump `steps` steps of `Net` with our PrecisionDebugger into `root`; returns `root`."""
    torch.manual_seed(0)
    model = Net(blocks, gain)
    debugger = PrecisionDebugger({"task": task, "dump_path": str(root), "level": level, "strict": True})
    with debugger:
        train(model, steps, debugger.start, debugger.stop, debugger.step)
    return Path(root)
