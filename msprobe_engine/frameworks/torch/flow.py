"""Which statistics row first measured each tensor of a micro-step (row reuse and incidents).

Within a micro-step every tensor measured by a module's forward hook is remembered by
identity (weakly, with its in-place version counter). A later row of such a tensor (an
input that is an earlier call's output, a parent returning its child's output) repeats the
earlier row instead of measuring the tensor again. A view that spans all of another tensor,
such as what `register_full_backward_hook` hands a module instead of its input, counts as
that tensor. With a `CallGraph` (incidents), what each call read goes into it too: inputs no
earlier row measured (made by code outside the watched modules: data, ``x + attn(x)``) are
measured once, as hidden ``actv_in`` rows unless inputs are watched anyway.
"""
from __future__ import annotations

import torch

from msprobe_engine.frameworks.torch.tensor_identity import KnownTensors, version
from msprobe_engine.incident.graph import INPUT_KIND, CallGraph
from msprobe_engine.stats.table import MetricKey

Named = list[tuple[str, torch.Tensor]]
#: a row of a call: its key, the tensor, and the key of the earlier row of that tensor (or None)
Row = tuple[MetricKey, torch.Tensor, "MetricKey | None"]


class TensorFlow:
    """The rows of module calls. `inputs`/`outputs`: every input/output is an ``actv`` row
    (``watch.module_inputs``/``module_outputs``); `graph`: where to note what each call read
    (None: no incidents)."""

    def __init__(self, graph: CallGraph | None, inputs: bool, outputs: bool) -> None:
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self._seen = KnownTensors()

    @property
    def reads_inputs(self) -> bool:
        """Whether `note_call` needs the call's inputs."""
        return self.inputs or self.graph is not None

    def new_micro_step(self) -> None:
        self._seen = KnownTensors()

    def note_call(self, call: str, inputs: Named, outputs: Named) -> tuple[list[Row], list[Row]]:
        """The rows of a call that read `inputs` and returned `outputs`: those of its inputs
        (every input when inputs are watched, else the hidden rows of those no earlier row
        measured) and of its outputs (when watched). A tensor a row of this micro-step measured
        comes with that row's key (a view that spans another tensor is given as that tensor:
        its gradient is the one that counts)."""
        graph = self.graph
        input_rows: list[Row] = []
        reads: dict[str, MetricKey] = {}
        for role, tensor in inputs:
            tensor = _resolve(tensor)
            prior = self._lookup(tensor)
            if self.inputs:
                own = MetricKey("actv", call, role)
                input_rows.append((own, tensor, self._noted(tensor, own, prior)))
                reads[role] = own
            elif prior is None:
                own = MetricKey(INPUT_KIND, call, role)
                input_rows.append((own, tensor, self._noted(tensor, own, prior)))
                reads[role] = own
            else:
                reads[role] = prior
        if graph is not None:
            graph.reads[call] = reads
        output_rows: list[Row] = []
        if self.outputs:
            for role, tensor in outputs:
                tensor = _resolve(tensor)
                key = MetricKey("actv", call, role)
                output_rows.append((key, tensor, self._noted(tensor, key, self._lookup(tensor))))
        return input_rows, output_rows

    def _noted(self, tensor: torch.Tensor, key: MetricKey, prior: MetricKey | None) -> MetricKey | None:
        """Note the row `key` of `tensor`, which `prior` measured earlier (or None: `key` is its
        first row this micro-step, though it may have been another's before). Returns `prior`."""
        graph = self.graph
        if prior is None:
            self._seen.put(tensor, version(tensor), key)
            if graph is not None:
                graph.same.pop(key, None)
        elif graph is not None:
            graph.same[key] = graph.tensor_of(prior)
        return prior

    def _lookup(self, tensor: torch.Tensor) -> MetricKey | None:
        """The row that measured this tensor, unchanged since, in this micro-step (or None)."""
        return self._seen.get(tensor, version(tensor))


def _resolve(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a view stands for when it spans all of it (same dtype, shape, strides, offset)."""
    base = tensor._base
    if base is not None and base.dtype == tensor.dtype and base.shape == tensor.shape \
            and base.stride() == tensor.stride() and base.storage_offset() == tensor.storage_offset():
        return base
    return tensor
