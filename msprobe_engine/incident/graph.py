"""What the module hooks know about the module calls of a step, kept on the host.

For every module call (named like its statistics rows: ``path``, ``path:1``, ...) the hooks
note which statistics row measured each of its inputs, and which rows measured one and the
same tensor (a parent returning its child's output, a module reading another's output).
With that, the step's statistics alone say whether a call's inputs were finite (forward)
and which calls consumed a tensor whose gradient went bad (backward): no tensor is kept and
nothing extra is transferred.

Inputs that no earlier row measured (made by code outside the watched modules: the data,
``x + attn(x)``) are measured once under the kind `INPUT_KIND`, and their gradients under
`INPUT_GRAD_KIND`; those rows serve incidents only and are not metrics.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from msprobe_engine.stats.table import MetricKey

#: an input measured for incidents only (no earlier row measured that tensor)
INPUT_KIND = "actv_in"
#: the gradient with respect to such an input
INPUT_GRAD_KIND = "actv_in_grad"
#: row kinds that are not metrics (never written to the sinks, never watched by rules)
HIDDEN_KINDS = frozenset({INPUT_KIND, INPUT_GRAD_KIND})


def module_path(call: str) -> str:
    """The module path of a call name (``layers.0.mlp:1`` -> ``layers.0.mlp``)."""
    return call.split(":", 1)[0]


def call_index(call: str) -> int:
    """The call counter of a call name (``layers.0.mlp:1`` -> 1, ``layers.0.mlp`` -> 0)."""
    _, _, n = call.partition(":")
    return int(n) if n else 0


def is_ancestor(outer: str, inner: str) -> bool:
    """True when the module of call `outer` contains the module of call `inner`."""
    a, b = module_path(outer), module_path(inner)
    return a != b and (a == "" or b.startswith(a + "."))


@dataclass
class CallGraph:
    """Module classes, the rows each call read, and which rows measured the same tensor."""
    classes: dict[str, str] = field(default_factory=dict)
    reads: dict[str, dict[str, MetricKey]] = field(default_factory=dict)
    same: dict[MetricKey, MetricKey] = field(default_factory=dict)

    def tensor_of(self, key: MetricKey) -> MetricKey:
        """The first row that measured the tensor measured by `key` (itself if none earlier)."""
        return self.same.get(key, key)

    def consumers(self, key: MetricKey) -> list[str]:
        """The calls that read the tensor measured by `key`, in the order they were noted."""
        tensor = self.tensor_of(key)
        return [call for call, inputs in self.reads.items()
                if any(self.tensor_of(k) == tensor for k in inputs.values())]

    def copy(self) -> "CallGraph":
        """A snapshot the writer thread may read while the hooks go on noting."""
        return CallGraph(dict(self.classes), {c: dict(r) for c, r in self.reads.items()}, dict(self.same))
