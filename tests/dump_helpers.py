"""Real dumps of the tiny GPT (examples/tiny_gpt.py) for tests: train N steps under a dump session.

    from dump_helpers import tiny_gpt_dump
    root = tiny_gpt_dump(tmp_path / "run", steps=3, level="mix", inject_layer="layers.1.mlp", inject_step=1)
    dumps = load_dump(root)        # {(step, None): RankDump}; single process: step{N}/proc<pid>/

`inject_layer` makes that module emit nan (or inf, or a x1000 spike: `kind`) at optimizer
step `inject_step` (examples.tiny_gpt.inject). Small model sizes keep a step at a few ms.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from examples.tiny_gpt import GPTConfig, TinyGPT, inject, synthetic_batches
from msprobe_engine.dump import PrecisionDebugger

SMALL = GPTConfig(vocab=64, dim=32, heads=2, layers=2, seq=16, batch=2)


def train_tiny_gpt(steps: int, debugger: PrecisionDebugger | None = None, *, cfg: GPTConfig = SMALL,
                   inject_layer: str | None = None, inject_step: int = 0, kind: str = "nan",
                   seed: int = 0) -> list[float]:
    """Train `steps` steps (AdamW) under `debugger` (start/stop/step around each); the losses."""
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = [0]
    if inject_layer is not None:
        inject(model, inject_layer, lambda: step[0], inject_step, kind)
    losses = []
    for step[0], (tokens, targets) in enumerate(synthetic_batches(cfg, steps, seed=seed)):
        if debugger is not None:
            debugger.start(model)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if debugger is not None:
            debugger.stop()
            debugger.step()
    return losses


def tiny_gpt_dump(root: Path, steps: int = 2, level: str = "L0", task: str = "statistics", *,
                  inject_layer: str | None = None, inject_step: int = 0, kind: str = "nan", seed: int = 0,
                  **config: Any) -> Path:
    """Dump `steps` steps of the tiny GPT into `root` (the dump_path) and return `root`.

    Extra keyword arguments are config keys (``step=[1]``, ``scope=[...]``, ``summary_mode="md5"``...)."""
    debugger = PrecisionDebugger({"task": task, "dump_path": str(root), "level": level, "strict": True, **config})
    with debugger:
        train_tiny_gpt(steps, debugger, inject_layer=inject_layer, inject_step=inject_step, kind=kind, seed=seed)
    return Path(root)
