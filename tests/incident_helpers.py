"""Shared set-up of the incident tests: a small demo model, fault injection, a training loop."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from examples.tiny_gpt import GPTConfig, TinyGPT, corrupt_where, step_tensor, synthetic_batches

#: the demo model, smaller: a step takes a few milliseconds
SMALL = GPTConfig(vocab=64, dim=32, heads=2, layers=2, seq=16, batch=4)


def gpt_and_adam(seed: int = 0) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(SMALL)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def config(tmp_path: Path, **overrides) -> dict:
    """Strict mode, no sinks, the non_finite rule (action `skip` unless overridden)."""
    return {"strict": True, "output_dir": str(tmp_path), "sinks": [],
            "alerts": [{"rule": "non_finite", "action": "skip"}], **overrides}


class NanGrad(torch.autograd.Function):
    """Identity forward; the backward puts a nan (or inf) into the gradient it passes on."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.view(-1)[0] = ctx.value
        return grad, None


class NanGradAt(torch.autograd.Function):
    """`NanGrad` where `hit` (a bool 0-d tensor) is true, else the identity: tensor ops only."""

    @staticmethod
    def forward(ctx, x, hit, kind):
        ctx.save_for_backward(hit)
        ctx.kind = kind
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (hit,) = ctx.saved_tensors
        return corrupt_where(grad, hit, ctx.kind), None, None


def inject_backward(model: torch.nn.Module, layer: str, step_of: Callable[[], int], at_step: int,
                    kind: str = "nan", how: str = "function", *, traced: bool = False):
    """Make the backward of module `layer` produce a non-finite gradient at step `at_step`.

    `function`: its output passes through `NanGrad`, so the gradient entering its own backward
    is corrupted; `full_hook`: a full backward hook corrupts the gradient it returns for its input.
    `traced` (`function` only): the output always passes through `NanGradAt`, which compares the
    step as a tensor in the backward (`tiny_gpt.step_tensor`): a compiled forward compiles once.
    """
    module = model.get_submodule(layer)
    value = float("nan") if kind == "nan" else float("inf")
    if how == "function" and traced:
        step = step_tensor(model, step_of)
        return module.register_forward_hook(lambda mod, args, output: NanGradAt.apply(output, step == at_step, kind))
    if how == "function":
        def forward_hook(mod, args, output):
            if step_of() == at_step:
                return NanGrad.apply(output, value)
        return module.register_forward_hook(forward_hook)

    def backward_hook(mod, grad_input, grad_output):
        if step_of() == at_step:
            bad = grad_input[0].clone()
            bad.view(-1)[0] = value
            return (bad, *grad_input[1:])
    return module.register_full_backward_hook(backward_hook)


def run(model, optimizer, monitor, steps: int, seed: int = 0, through_run_step: bool = True,
        on_step: Callable[[], None] | None = None) -> list[torch.Tensor]:
    """Train `steps` steps; each step through `monitor.run_step` unless told otherwise.
    `on_step` runs after the backward of every call of the step function (replays included)."""
    def train_step(tokens, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        if on_step is not None:
            on_step()
        optimizer.step()
        return loss.detach()

    losses = []
    for tokens, targets in synthetic_batches(model.cfg, steps, seed=seed):
        loss = monitor.run_step(train_step, tokens, targets) if through_run_step else train_step(tokens, targets)
        monitor.step_end(loss)
        losses.append(loss)
    return losses


def read_incident(directory: Path) -> dict:
    return json.loads((directory / "incident.json").read_text())
