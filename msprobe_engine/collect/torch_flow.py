"""Which statistics row measured each tensor a module call reads (for incidents).

Within a micro-step every tensor measured by a module's forward hook is remembered by
identity (weakly, with its in-place version counter). An input of a later call that is
such a tensor refers to that row and costs nothing; any other input (made by code outside
the watched modules: data, ``x + attn(x)``) is measured once and remembered too. A view
that spans all of another tensor, such as what `register_full_backward_hook` hands a
module instead of its input, counts as that tensor. What each call read goes into the
monitor's `CallGraph`.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from msprobe_engine.dump.stat_buffer import version
from msprobe_engine.incident.graph import INPUT_KIND, CallGraph
from msprobe_engine.stats.table import MetricKey

Named = list[tuple[str, torch.Tensor]]


class TensorFlow:
    """Notes module calls into `graph`. `own_inputs`: every input is measured anyway as an
    ``actv`` input row (``watch.module_inputs``), so each call reads its own rows."""

    def __init__(self, graph: CallGraph, own_inputs: bool) -> None:
        self.graph = graph
        self.own_inputs = own_inputs
        self.input_kind = "actv" if own_inputs else INPUT_KIND
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def new_micro_step(self) -> None:
        self._seen = WeakIdKeyDictionary()

    def note_call(self, call: str, inputs: Named, outputs: Named) -> list[tuple[MetricKey, torch.Tensor]]:
        """Note what `call` read and returned (`outputs` are measured as ``actv`` rows). Returns
        the inputs no earlier row measured, with the keys to measure them under (a view that
        spans another tensor is returned as that tensor: its gradient is the one that counts)."""
        graph = self.graph
        reads: dict[str, MetricKey] = {}
        fresh = []
        for role, tensor in inputs:
            tensor = _resolve(tensor)
            own = MetricKey(self.input_kind, call, role)
            prior = self._lookup(tensor)
            if prior is None:
                fresh.append((own, tensor))
                self._note(tensor, own)
                reads[role] = own
            elif self.own_inputs:
                graph.same[own] = graph.tensor_of(prior)
                reads[role] = own
            else:
                reads[role] = prior
        graph.reads[call] = reads
        for role, tensor in outputs:
            tensor = _resolve(tensor)
            key = MetricKey("actv", call, role)
            prior = self._lookup(tensor)
            if prior is None:
                self._note(tensor, key)
            else:
                graph.same[key] = graph.tensor_of(prior)
        return fresh

    def _note(self, tensor: torch.Tensor, key: MetricKey) -> None:
        """`key` is the first row of `tensor` (this step; it may have been another's before)."""
        self._seen[tensor] = (version(tensor), key)
        self.graph.same.pop(key, None)

    def _lookup(self, tensor: torch.Tensor) -> MetricKey | None:
        """The row that measured this tensor, unchanged since, in this micro-step (or None)."""
        found = self._seen.get(tensor)
        return found[1] if found is not None and found[0] == version(tensor) else None


def _resolve(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a view stands for when it spans all of it (same dtype, shape, strides, offset)."""
    base = tensor._base
    if base is not None and base.dtype == tensor.dtype and base.shape == tensor.shape \
            and base.stride() == tensor.stride() and base.storage_offset() == tensor.storage_offset():
        return base
    return tensor
