"""A model the alert tests (and `check-config --model tests.health_models:build`) use: a
small residual MLP learning a fixed random teacher, with faults injected at chosen steps.

Not the example model: the held-out alert tests must not be tuned on what the rules were
developed on.
"""
from __future__ import annotations

import torch
from torch import nn

WIDTH = 16
INPUTS = 8
BATCH = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class ResidualMLP(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(INPUTS, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(depth)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def build(seed: int = 0) -> ResidualMLP:
    """The model, seeded (the `--model` factory of check-config)."""
    torch.manual_seed(seed)
    return ResidualMLP()


class Teacher:
    """Batches of a fixed random regression task (the loss falls as the model learns it)."""

    def __init__(self, seed: int = 1) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.w = torch.randn(INPUTS, 1, generator=self.gen)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(BATCH, INPUTS, generator=self.gen)
        return x, torch.tanh(x @ self.w) + 0.05 * torch.randn(BATCH, 1, generator=self.gen)


class Faults:
    """Forward hooks that corrupt a module's output at given steps: {step: (module path, kind)},
    kind `spike` (x`factor`) or `nan`. Install before the monitor, so that its hooks (which run
    after these) measure the corrupted output."""

    def __init__(self, model: nn.Module, plan: dict[int, tuple[str, str]], factor: float = 10.0) -> None:
        self.plan = plan
        self.factor = factor
        self.step = 0
        modules = dict(model.named_modules())
        self.handles = [modules[path].register_forward_hook(self._hook(path))
                        for path in {path for path, _ in plan.values()}]

    def _hook(self, path: str):
        def hook(module, args, output):
            fault = self.plan.get(self.step)
            if fault is None or fault[0] != path:
                return None
            if fault[1] == "nan":
                output = output.clone()
                output[0, 0] = float("nan")
                return output
            return output * self.factor
        return hook


def train(model: nn.Module, monitor, steps: int, optimizer: torch.optim.Optimizer, faults: Faults | None = None,
          lr_at: dict[int, float] | None = None, teacher: Teacher | None = None) -> list[float]:
    """`steps` optimizer steps; a step whose loss is not finite is not applied (as a loss
    scaler would). `lr_at`: {step: new learning rate}. Returns the losses."""
    teacher = teacher or Teacher()
    losses = []
    for step in range(steps):
        if faults is not None:
            faults.step = step
        for group in optimizer.param_groups:
            group["lr"] = (lr_at or {}).get(step, group["lr"])
        x, y = teacher.batch()
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if torch.isfinite(loss):
            optimizer.step()
        monitor.step_end(loss)
        losses.append(float(loss.detach()))
    return losses
