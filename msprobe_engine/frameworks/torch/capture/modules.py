"""Module hooks for the dump (L0, mix): forward pre/post hooks and parameter-gradient hooks.

Every submodule of the model (not the model itself, as in the predecessor) gets a forward
pre-hook and a forward hook that hand its arguments and result to the recorder, which names
the call ``Module.<path>.<Class>.forward.<n>``. Backward gradients are collected by the
recorder without ``register_full_backward_hook`` (see `collect.torch_backward`), so modules
that work in place keep working. Each direct parameter gets a tensor hook for
``Module.<path>.<Class>.parameters_grad.<n>``. Hooks return None: nothing is modified.
A list of models is named ``Module.<i>.<path>...``, as the predecessor does.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Sequence, Union

import torch

from msprobe_engine.handles import Handles

if TYPE_CHECKING:
    from msprobe_engine.frameworks.torch.capture.recorder import Recorder

Models = Union[torch.nn.Module, Sequence[torch.nn.Module]]


def module_keys(models: Models) -> dict[str, torch.nn.Module]:
    """``Module.<path>.<Class>`` -> module, for every submodule the dump hooks."""
    if isinstance(models, torch.nn.Module):
        groups = [("", models)]
    else:
        groups = [(f"{i}.", m) for i, m in enumerate(models)]
    keys = {}
    for prefix, model in groups:
        for name, module in model.named_modules():
            if module is not model:
                keys[f"Module.{prefix}{name}.{type(module).__name__}"] = module
    return keys


class DumpModuleHooks(Handles):
    """Installs and removes the dump's hooks on the submodules of one model (or list of models)."""

    def __init__(self, recorder: "Recorder", models: Models) -> None:
        self.handles: list = []
        for key, module in module_keys(models).items():
            self.handles.append(module.register_forward_pre_hook(partial(self._pre, recorder, key),
                                                                 with_kwargs=True))
            self.handles.append(module.register_forward_hook(partial(self._post, recorder), with_kwargs=True,
                                                             always_call=True))
            for name, param in module.named_parameters(recurse=False):
                if param.requires_grad:
                    self.handles.append(param.register_hook(partial(recorder.param_grad, key, name)))

    @staticmethod
    def _pre(recorder: "Recorder", key: str, module, args, kwargs) -> None:
        recorder.module_begin(key, module, args, kwargs)

    @staticmethod
    def _post(recorder: "Recorder", module, args, kwargs, output) -> None:
        recorder.module_end(module, args, kwargs, output)
