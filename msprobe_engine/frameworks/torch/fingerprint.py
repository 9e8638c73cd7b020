"""Fingerprints for `config-check`: of a batch (data order) and of a model's weights (checkpoints).

Each is a sha256 over every tensor's dtype, shape and bytes, so two runs that read the same
data in the same order, or load the same checkpoint, have equal fingerprints. They copy the
tensors to the host: call them for the first few batches and once after loading weights,
not on every step::

    monitor.record_environment(weights=weight_fingerprints(model))
    batches = []
    for i, batch in enumerate(data):
        if i < 4:
            batches.append(batch_fingerprint(batch))
            if i == 3:
                monitor.record_environment(data={"batches": batches})
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from msprobe_engine.collect.flatten import iter_tensors


def _update(digest: Any, tensor: torch.Tensor) -> None:
    tensor = tensor.detach()
    digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    if tensor.numel():
        digest.update(tensor.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())


def batch_fingerprint(batch: Any) -> str:
    """sha256 (first 16 hex digits) of every tensor of `batch` (nested lists, tuples, dicts)."""
    digest = hashlib.sha256()
    for _, tensor in iter_tensors(batch, "batch", lambda v: isinstance(v, torch.Tensor)):
        _update(digest, tensor)
    return digest.hexdigest()[:16]


def weight_fingerprints(model: Any) -> dict[str, str]:
    """Parameter/buffer name -> sha256 (first 16 hex digits), of a module or a state dict."""
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    out = {}
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            digest = hashlib.sha256()
            _update(digest, tensor)
            out[name] = digest.hexdigest()[:16]
    return out
