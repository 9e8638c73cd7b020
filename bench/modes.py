"""The modes of the overhead suite: how one training step runs under each tool.

A mode is made by `make(name, model, optimizer, out)` and exposes ``run(step)``, where
`step()` does forward, backward and the optimizer step, and ``close()``.

- ``none``: no tool.
- ``floor_<config>``: the least a tool can do for what `configs/<config>.yaml` watches: the
  same hooks (forward hooks on the watched modules, gradient hooks on their outputs, the
  optimizer's pre/post-step hooks), ONE sum per monitored tensor kept on the device, and one
  host transfer per step.
- ``ours_<config>``: `TorchMonitor` with `configs/<config>.yaml` as shipped ("default": no
  config file at all).
- ``pred_<config>``: the predecessor's `TrainerMon` (mindstudio-probe) with the equivalent
  monitor config (`PREDECESSOR`). At most one per process: it patches torch's BackwardHook.
- ``ours_dump_<level>`` / ``pred_dump_<level>``: a statistics dump of every step at level
  L0, L1 or mix, ours and the predecessor's `PrecisionDebugger` (a singleton: one a process).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
Step = Callable[[], torch.Tensor]

#: the predecessor's monitor config equivalent to each of ours (same tensors and statistics)
_PRED_OPS = ["min", "max", "mean", "norm", "nans"]
PREDECESSOR = {
    "grads_optimizer": {"wg_distribution": True, "mv_distribution": True, "ops": _PRED_OPS},
    "default": {"xy_distribution": True, "forward_only": True, "wg_distribution": True,
                "mv_distribution": True, "ops": _PRED_OPS},
    "full": {"xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
             "param_distribution": True, "ur_distribution": True, "ops": [*_PRED_OPS, "zeros"]},
}
CONFIGS = tuple(PREDECESSOR)


def our_config(name: str, out: Path):
    """Our MonitorConfig for `name` (configs/<name>.yaml; "default": built-in defaults)."""
    from msprobe_engine.config import load_config

    config = load_config(None if name == "default" else ROOT / "configs" / f"{name}.yaml")
    return dataclasses.replace(config, output_dir=str(out))


class NoTool:
    def run(self, step: Step) -> torch.Tensor:
        return step()

    def close(self) -> None:
        pass


class Floor:
    """One sum per watched tensor in the hooks a monitor needs, one transfer per step.
    `watched(name)`: whether module `name` is hooked (default: every module but the root);
    `merge(sums)`: the step's sums merged over the ranks in place before the transfer (one
    collective: what any multi-rank tool needs)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, watch, *,
                 watched: Callable[[str], bool] = bool,
                 merge: Callable[[torch.Tensor], object] | None = None) -> None:
        self.sums: list[torch.Tensor] = []
        self.merge = merge
        self.watch = watch
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.optimizer = optimizer
        self.before: list[torch.Tensor] | None = None
        self.update = any(s in ("update", "ratio") for s in watch.optimizer_state)
        self.states = [s for s in watch.optimizer_state if s in ("exp_avg", "exp_avg_sq")]
        if watch.module_outputs or watch.module_inputs or watch.activation_grads:
            for name, module in model.named_modules():
                if watched(name):
                    module.register_forward_hook(self._forward, with_kwargs=True)
        optimizer.register_step_pre_hook(self._pre_step)
        optimizer.register_step_post_hook(self._post_step)

    def _grad(self, grad: torch.Tensor) -> None:
        self.sums.append(grad.detach().sum(dtype=torch.float32))

    def _forward(self, module, args, kwargs, output) -> None:
        if self.watch.module_inputs:
            self.sums += [t.detach().sum(dtype=torch.float32) for t in (*args, *kwargs.values())
                          if isinstance(t, torch.Tensor)]
        outputs = [t for t in (output if isinstance(output, (tuple, list)) else [output])
                   if isinstance(t, torch.Tensor)]
        for t in outputs:
            if self.watch.module_outputs:
                self.sums.append(t.detach().sum(dtype=torch.float32))
            if self.watch.activation_grads and t.requires_grad and t.grad_fn is not None:
                t.register_hook(self._grad)

    def _pre_step(self, optimizer, args, kwargs) -> None:
        if self.watch.param_grads:
            self.sums += [p.grad.sum(dtype=torch.float32) for p in self.params if p.grad is not None]
        if self.update:  # the parameters' negated copy, into buffers kept between steps (as ours on CPU)
            if self.before is None:
                self.before = [torch.empty_like(p) for p in self.params]
            for kept, p in zip(self.before, self.params):
                torch.neg(p.detach(), out=kept)

    def _post_step(self, optimizer, args, kwargs) -> None:
        if self.watch.params or self.update:
            self.sums += [p.detach().sum(dtype=torch.float32) for p in self.params]
        for p in self.params:
            state = optimizer.state.get(p, {})
            self.sums += [state[s].sum(dtype=torch.float32) for s in self.states if s in state]
        if self.update:
            torch._foreach_add_(self.before, [p.detach() for p in self.params])  # after - before
            self.sums += [u.sum(dtype=torch.float32) for u in self.before]

    def run(self, step: Step) -> torch.Tensor:
        loss = step()
        self.sums.append(loss.detach().float())
        sums = torch.stack(self.sums)
        if self.merge is not None:
            self.merge(sums)
        sums.cpu()  # the one transfer
        self.sums = []
        return loss

    def close(self) -> None:
        pass


class Ours:
    def __init__(self, model, optimizer, config) -> None:
        from msprobe_integrations.torch import TorchMonitor

        self.monitor = TorchMonitor(model, optimizer, config)

    def run(self, step: Step) -> torch.Tensor:
        loss = step()
        self.monitor.step_end(loss)
        return loss

    def close(self) -> None:
        self.monitor.close()


class Predecessor:
    """The predecessor's TrainerMon: hooks at `set_monitor`, writes in its patched optimizer.step."""

    def __init__(self, model, optimizer, config: str, out: Path) -> None:
        os.environ["MONITOR_OUTPUT_DIR"] = str(out)
        from msprobe.pytorch import TrainerMon

        out.mkdir(parents=True, exist_ok=True)
        targets = {name: {} for name, _ in model.named_modules() if name}
        settings = {"targets": targets, "all_xy": True, "format": "tensorboard", "start_step": 0,
                    "step_interval": 1, **PREDECESSOR[config]}
        path = out / "monitor.json"
        path.write_text(json.dumps(settings))
        self.monitor = TrainerMon(str(path), params_have_main_grad=False)
        self.monitor.set_monitor(model, optimizer)

    def run(self, step: Step) -> torch.Tensor:
        return step()

    def close(self) -> None:
        writer = getattr(self.monitor, "summary_writer", None)
        if writer is not None:
            writer.close()


class Dump:
    """A statistics dump of every step: ours (`msprobe_engine.dump`) or the predecessor's."""

    def __init__(self, model, level: str, out: Path, predecessor: bool) -> None:
        self.model = model
        self.predecessor = predecessor
        out.mkdir(parents=True, exist_ok=True)
        if predecessor:
            from msprobe.pytorch import PrecisionDebugger

            path = out / "config.json"
            path.write_text(json.dumps({"task": "statistics", "dump_path": str(out), "rank": [], "step": [],
                                        "level": level, "statistics": {"scope": [], "list": [],
                                                                       "data_mode": ["all"],
                                                                       "summary_mode": "statistics"}}))
            self.debugger = PrecisionDebugger(config_path=str(path))
        else:
            from msprobe_engine.dump import PrecisionDebugger

            self.debugger = PrecisionDebugger({"task": "statistics", "dump_path": str(out), "level": level})

    def run(self, step: Step) -> torch.Tensor:
        if not self.predecessor:
            with self.debugger.step_scope(self.model):
                return step()
        from msprobe.pytorch import PrecisionDebugger

        PrecisionDebugger.start(self.model)
        try:
            return step()
        finally:
            PrecisionDebugger.stop()
            PrecisionDebugger.step()

    def close(self) -> None:
        if not self.predecessor:
            self.debugger.close()


def make(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: Path):
    """The mode `name` (see the module docstring) set up on `model` and `optimizer`."""
    if name == "none":
        return NoTool()
    kind, _, rest = name.partition("_")
    if rest.startswith("dump_"):
        return Dump(model, rest.removeprefix("dump_"), out / name, predecessor=kind == "pred")
    if kind == "floor":
        return Floor(model, optimizer, our_config(rest, out / name).watch)
    if kind == "ours":
        return Ours(model, optimizer, our_config(rest, out / name))
    if kind == "pred":
        return Predecessor(model, optimizer, rest, out / name)
    raise ValueError(f"unknown mode {name!r}")
