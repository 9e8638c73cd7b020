"""A short monitored training run (tests of tools that read two runs: config-check, find-divergence)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from msprobe_engine import Monitor


def monitored_run(model: torch.nn.Module, config: dict[str, Any], batches: list[torch.Tensor],
                  before: Callable[[Monitor], None] | None = None) -> Path:
    """Train `model` (SGD, lr 0.1, loss: the output's sum) on `batches` under a Monitor built
    from `config`, one step each; `before(monitor)` runs before the first step. The run's directory."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(config).attach(model, opt)
    if before is not None:
        before(mon)
    for batch in batches:
        model(batch).sum().backward()
        opt.step()
        opt.zero_grad()
        mon.step_end()
    mon.close()
    return Path(config["output_dir"]) / config["run_name"]
