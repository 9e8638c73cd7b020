"""Megatron Bridge (`megatron-bridge`): a callback on its callback API, over `MegatronMonitor`.

    from msprobe_integrations.megatron_bridge import MonitorCallback
    pretrain(config, forward_step_func, callbacks=[MonitorCallback(config="configs/megatron/monitor.yaml")])

Bridge's `CallbackManager.add` registers a callback's methods by event name (those that
differ from its `Callback` base), so this class needs nothing from the package and is used
as it is:

- `on_train_start(context)`: `MegatronMonitor(context.model, context.optimizer, config)`,
  starting at Bridge's `train_state.step` (after a resume too). Activations, gradients
  (`prepare_grads`), weights and optimizer state are read by the Megatron-core adapter, which
  also applies `skip` (Megatron's step is not applied) and `stop` (`TrainingStopped` raised
  from the optimizer step, after the step's record and incident are written);
- `on_train_step_end(context)`: `step_end(context.loss_dict["lm loss"])` (the last pipeline
  stage has the loss; the others pass None);
- `on_train_end(context)`: `close()`.

Bridge's checkpoints do not save callback state: keep `callback.monitor.state_dict()` with
your checkpoint and give it back with `MonitorCallback(config, state=...)`.

Tested (tests/test_megatron_bridge.py) through Bridge's own `CallbackManager` and
`CallbackContext` from megatron-bridge 0.6.2's callbacks module, on megatron-core 0.19.2 in the
Python 3.12 lane (the package itself does not import on a CPU: its `__init__` imports every model
bridge, which needs Transformer Engine), and in Bridge's event order with stand-in contexts on
megatron-core 0.16.1; see docs/megatron_bridge.md.
"""
from __future__ import annotations

from typing import Any

from msprobe_engine.config import ConfigSource

__all__ = ["MonitorCallback"]

#: the key of the language-model loss in Bridge's (and Megatron-LM's) `loss_dict`
LOSS_KEY = "lm loss"


class MonitorCallback:
    """A Megatron Bridge training callback (see the module docstring); `.monitor` is the
    `MegatronMonitor` from `on_train_start` on."""

    def __init__(self, config: ConfigSource = None, *, state: dict[str, Any] | None = None,
                 loss_key: str = LOSS_KEY) -> None:
        self.config = config
        self.state = state
        self.loss_key = loss_key
        self.monitor = None

    def on_train_start(self, context: Any) -> None:
        from msprobe_integrations.megatron import MegatronMonitor

        self.monitor = MegatronMonitor(context.model, context.optimizer, self.config,
                                       start_step=context.state.train_state.step)
        if self.state:
            self.monitor.load_state_dict(self.state)

    def on_train_step_end(self, context: Any) -> None:
        self.monitor.step_end((context.loss_dict or {}).get(self.loss_key))

    def on_train_end(self, context: Any) -> None:
        self.monitor.close()
