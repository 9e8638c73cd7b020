"""The predecessor's training-state monitor entry point: ``TrainerMon(config).set_monitor(...)``.

Its monitor JSON is read as it is (`msprobe_engine.config.legacy` maps the keys); the monitor
is this project's `TorchMonitor` (plain PyTorch, DDP, FSDP2). As in the predecessor the
training loop is not touched: each `optimizer.step()` closes the step's record (a post-step
hook), and what is open is written when the process exits. ``output_dir`` defaults to
``$MONITOR_OUTPUT_DIR`` (the predecessor's variable), else ``./monitor_output``.
"""
from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Any

from msprobe_engine.errors import ConfigError
from msprobe_engine.config.loader import from_dict, read_file

log = logging.getLogger("msprobe_engine")
#: the predecessor's default output directory, and the variable that moves it
DEFAULT_OUTPUT_DIR = "./monitor_output"
OUTPUT_DIR_ENV = "MONITOR_OUTPUT_DIR"


class TrainerMon:
    """The predecessor's `TrainerMon`; `monitor` is the `TorchMonitor` once `set_monitor` ran."""

    def __init__(self, config_file_path: str | Path, process_group: Any = None, params_have_main_grad: bool = True,
                 opt_ty: Any = None) -> None:
        """`config_file_path`: its monitor JSON (or one of ours); `process_group`,
        `params_have_main_grad`, `opt_ty` (the predecessor's) are accepted: the groups come from
        the model's wrapping and the gradients from the optimizer here."""
        path = Path(config_file_path)
        data = read_file(path)
        data.setdefault("output_dir", os.environ.get(OUTPUT_DIR_ENV, DEFAULT_OUTPUT_DIR))
        self.config = from_dict(data, str(path))
        self.config_file_path = path
        self.monitor: Any = None
        self._hook: Any = None

    def set_monitor(self, model: Any, optimizer: Any = None, grad_acc_steps: Any = 1, tp_group: Any = None,
                    dp_group: Any = None, start_iteration: int = 0) -> "TrainerMon":
        """Hook `model` (a module, or a list of one) and `optimizer`. Both argument orders of the
        predecessor are taken: ``(model, optimizer, grad_acc_steps)`` (26.x) and
        ``(model, grad_acc_steps, optimizer)`` (1.x)."""
        import torch

        from msprobe_integrations.torch import TorchMonitor

        if isinstance(optimizer, int) and not isinstance(optimizer, bool):
            optimizer, grad_acc_steps = grad_acc_steps, optimizer
        if isinstance(grad_acc_steps, bool) or not isinstance(grad_acc_steps, int) or grad_acc_steps < 1:
            raise ConfigError(f"set_monitor: grad_acc_steps: expected a positive integer, got {grad_acc_steps!r}")
        if isinstance(start_iteration, bool) or not isinstance(start_iteration, int) or start_iteration < 0:
            raise ConfigError(f"set_monitor: start_iteration: expected an integer >= 0, got {start_iteration!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"set_monitor: optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
                              " (the step is closed by the optimizer's step)")
        if isinstance(model, (list, tuple)):
            if len(model) != 1:
                raise ConfigError(f"set_monitor: {len(model)} model chunks (virtual pipeline): use "
                                  "msprobe_integrations.megatron.MegatronMonitor(model_chunks, optimizer, config=...)")
            model = model[0]
        if self.monitor is not None:
            raise ConfigError("set_monitor: this TrainerMon already monitors a model")
        if tp_group is not None or dp_group is not None:
            log.info("msprobe monitor: tp_group/dp_group are taken from the model's wrapping (DDP, FSDP2) here")
        self.monitor = TorchMonitor(model, optimizer, self.config, start_step=start_iteration)
        self._hook = optimizer.register_step_post_hook(self._step_done)
        atexit.register(self.close)
        return self

    # the predecessor's 1.x name for the same call, with its argument order
    def monitor_gnorm_with_ad(self, model: Any, grad_acc_steps: int = 1, optimizer: Any = None, dp_group: Any = None,
                              tp_group: Any = None, start_iteration: int = 0) -> "TrainerMon":
        """`set_monitor` under the predecessor's 1.x name."""
        return self.set_monitor(model, optimizer, grad_acc_steps, tp_group, dp_group, start_iteration)

    def _step_done(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.monitor.step_end()

    def close(self) -> None:
        """Write what is open and close the sinks (also run at exit)."""
        if self.monitor is None:
            return
        self._hook.remove()
        monitor, self.monitor = self.monitor, None
        monitor.close()
        atexit.unregister(self.close)
