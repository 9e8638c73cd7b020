"""Build small L0 dumps in the reference layout from a tiny torch model, optionally with a nan
injected into the output of one named layer. (To be replaced by the engine's dump writer.)"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

LAYERS = ["layers.0", "layers.1", "layers.2", "layers.3", "layers.4"]


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class _Dumper:
    def __init__(self, rank_dir: Path, task: str) -> None:
        self.rank_dir, self.task = rank_dir, task
        self.data: dict[str, Any] = {}
        if task == "tensor":
            (rank_dir / "dump_tensor_data").mkdir(parents=True)

    def record(self, t: torch.Tensor | None, data_name: str) -> dict[str, Any] | None:
        if t is None:
            return None
        t = t.detach()
        floating = t.is_floating_point()
        rec: dict[str, Any] = {
            "type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape),
            "Max": t.max().item(), "Min": t.min().item(),
            "Mean": t.double().mean().item() if floating else None,
            "Norm": t.double().norm().item() if floating else None,
            "requires_grad": t.requires_grad,
        }
        if self.task == "tensor":
            rec["data_name"] = data_name + ".pt"
            torch.save(t.clone(), self.rank_dir / "dump_tensor_data" / rec["data_name"])
        return rec

    def forward_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            entry = f"Module.{name}.{type(module).__name__}.forward.0"
            self.data[entry] = {
                "input_args": [self.record(a, f"{entry}.input.{i}") for i, a in enumerate(args)],
                "input_kwargs": {},
                "output": [self.record(output, f"{entry}.output.0")],
            }
            params = dict(module.named_parameters(recurse=False))
            if params:
                self.data[entry]["parameters"] = {k: self.record(p, f"{entry}.parameters.{k}")
                                                  for k, p in params.items()}
        return hook

    def backward_hook(self, name: str):
        def hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            entry = f"Module.{name}.{type(module).__name__}.backward.0"
            self.data[entry] = {"input": [self.record(g, f"{entry}.input.{i}") for i, g in enumerate(grad_output)],
                                "output": [self.record(g, f"{entry}.output.{i}") for i, g in enumerate(grad_input)]}
        return hook

    def parameters_grad(self, name: str, module: nn.Module) -> None:
        entry = f"Module.{name}.{type(module).__name__}.parameters_grad"
        params = dict(module.named_parameters(recurse=False))
        if params:
            self.data[entry] = {k: [self.record(p.grad, f"{entry}.{k}")] for k, p in params.items()}


def _inject_nan(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    output = output.clone()
    output.view(-1)[0] = float("nan")
    return output


def build_dump(root: Path, inject_nan_into: str | None = None, task: str = "tensor", seed: int = 0) -> Path:
    """Run one forward/backward step of TinyNet and dump it under ``root/step0/rank0``; returns the rank dir."""
    torch.manual_seed(seed)
    model = TinyNet()
    x = torch.randn(4, 8)
    rank_dir = root / "step0" / "rank0"
    rank_dir.mkdir(parents=True)
    dumper = _Dumper(rank_dir, task)
    modules = {name: model.get_submodule(name) for name in LAYERS}
    for name, module in modules.items():
        if name == inject_nan_into:
            module.register_forward_hook(_inject_nan)
        module.register_forward_hook(dumper.forward_hook(name))
        module.register_full_backward_hook(dumper.backward_hook(name))
    model(x.requires_grad_()).sum().backward()
    for name, module in modules.items():
        dumper.parameters_grad(name, module)
    doc = {"task": task, "level": "L0", "framework": "pytorch", "dump_data_dir": None, "data": dumper.data}
    if task == "tensor":
        doc["dump_data_dir"] = str(rank_dir / "dump_tensor_data")
    (rank_dir / "dump.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return rank_dir


def stat_record(max_: float, min_: float, mean: float, norm: float, dtype: str = "torch.float32",
                shape: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    """A hand-written tensor record (statistics only unless ``data_name`` is passed)."""
    return {"type": "torch.Tensor", "dtype": dtype, "shape": shape or [2, 2], "Max": max_, "Min": min_,
            "Mean": mean, "Norm": norm, "requires_grad": False, **extra}


def write_dump_json(rank_dir: Path, data: dict[str, Any], task: str = "statistics", level: str = "L1") -> Path:
    """Write a dump.json with the given entries into ``rank_dir`` (created); returns the rank dir."""
    rank_dir.mkdir(parents=True, exist_ok=True)
    doc = {"task": task, "level": level, "framework": "pytorch", "dump_data_dir": None, "data": data}
    (rank_dir / "dump.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return rank_dir
