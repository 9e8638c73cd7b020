"""A small model and one training step, dumped by the real predecessor (mindstudio-probe) or by us.

The predecessor patches torch process-wide and keeps a singleton debugger, so each of its
dumps runs in a child process (`predecessor_dump`); ours run in the test process
(`our_dump`). Both train the same model from the same seed on the same batch, one step
(forward, backward, Adam), so the two dumps describe the same computation.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

TESTS = Path(__file__).resolve().parent
#: the predecessor's command line, next to this interpreter
MSPROBE = Path(sys.executable).parent / "msprobe"
VOCAB, DIM = 32, 16


class Net(nn.Module):
    """Embedding, multi-head attention, LayerNorm, GELU, a head; in-place ops on intermediates.

    `inject`: a square root of negative values makes nan in the forward (first bad API:
    ``Tensor.sqrt.0.forward``)."""

    def __init__(self, inject: bool = False) -> None:
        super().__init__()
        self.inject = inject
        self.emb = nn.Embedding(VOCAB, DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.norm = nn.LayerNorm(DIM)
        self.act = nn.GELU()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        a, _ = self.attn(x, x.flip(1), x.roll(1, 1), need_weights=False)
        x = self.norm(x + a)
        h = self.act(x) + x
        h *= 0.5
        h.add_(x.tanh())
        if self.inject:
            h = h.sqrt()
        return self.head(h)


def train_step(debugger: Any = None, inject: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step from seed 0 under `debugger` (start/stop/step around it); the loss and the gradients."""
    torch.manual_seed(0)
    model = Net(inject)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, VOCAB, (2, 6), generator=g), torch.randint(0, VOCAB, (2, 6), generator=g)
    if debugger is not None:
        debugger.start(model)
    loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    if debugger is not None:
        debugger.stop()
        debugger.step()
    return loss.detach(), grads


def dump_config(root: Path, level: str, task: str = "statistics") -> dict[str, Any]:
    """A config.json as the predecessor's users write it (the task's section holds the options)."""
    return {"task": task, "dump_path": str(root), "rank": [], "step": [], "level": level,
            task: {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}


_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from msprobe.pytorch import PrecisionDebugger
from predecessor_helpers import train_step
debugger = PrecisionDebugger(config_path={config!r})
train_step(debugger, inject={inject!r})
"""


def predecessor_dumps(jobs: dict[str, tuple[Path, str, str, bool]], timeout: float = 300) -> dict[str, Path]:
    """Run the predecessor's PrecisionDebugger in one child process per job, all at once.

    `jobs`: name -> (dump_path, level, task, inject); returns name -> its ``step0`` directory."""
    children = {}
    for name, (root, level, task, inject) in jobs.items():
        root.mkdir(parents=True, exist_ok=True)
        config = root.parent / f"{root.name}.config.json"
        config.write_text(json.dumps(dump_config(root, level, task)))
        script = _CHILD.format(tests=str(TESTS), config=str(config), inject=inject)
        children[name] = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, env=_env())
    for name, child in children.items():
        out, _ = child.communicate(timeout=timeout)
        assert child.returncode == 0, f"the predecessor's dump {name} failed:\n{out[-3000:]}"
    return {name: root / "step0" for name, (root, *_rest) in jobs.items()}


def run_msprobe(*args: str, timeout: float = 300) -> str:
    """The predecessor's command line (``msprobe compare ...``); its output, asserting success."""
    done = subprocess.run([str(MSPROBE), *args], capture_output=True, text=True, timeout=timeout, env=_env())
    assert done.returncode == 0, f"msprobe {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}
