"""API cases of the pre-check: one per API call of a dump (its forward entry and, when dumped, its
backward entry), with the reason when a call cannot be replayed.

What cannot be replayed, and is reported ``SKIP`` with the reason (never left out silently):
communication ops (``Distributed.*``: they need the other ranks), random ops (their generator
state is not dumped), arguments the dump could not describe (recorded as ``{}``); the backward
of an in-place op (the dump holds its input before the write, not the autograd graph it joined).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from msprobe_engine.dump.reader import RankDump
from msprobe_engine.dump.schema import is_tensor_record, parse_entry_name

#: ops whose result depends on the random generator's state
RANDOM_APIS = frozenset((
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "rrelu",
    "gumbel_softmax", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "normal", "normal_", "bernoulli", "bernoulli_", "multinomial", "uniform_", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "random_", "poisson", "native_dropout",
))
#: creation ops: no tensor input, so no precision to check
NO_INPUT_APIS = frozenset(("empty", "empty_like", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
                           "arange", "range", "linspace", "logspace", "eye", "tensor", "as_tensor", "from_numpy"))


@dataclass
class ApiCase:
    """One API call: ``name`` is ``<Prefix>.<api>.<n>`` (the predecessor's "API name"), ``api``
    is ``<Prefix>.<api>``; ``forward``/``backward`` are its dump entries (``backward`` None when not
    dumped); ``source`` loads tensor files (None for cases that carry their tensors)."""
    name: str
    api: str
    forward: dict[str, Any]
    backward: dict[str, Any] | None = None
    source: RankDump | None = None

    @property
    def target(self) -> str:
        return self.api.split(".", 1)[1]

    @property
    def inplace(self) -> bool:
        leaf = self.target.rsplit(".", 1)[-1]
        return (leaf.endswith("_") and not leaf.endswith("__")) or leaf == "__setitem__" or (
            leaf.startswith("__i") and leaf not in ("__int__", "__invert__", "__index__"))

    def skip_reason(self) -> str | None:
        """Why this call cannot be replayed, or None."""
        prefix, leaf = self.api.split(".", 1)[0], self.target.rsplit(".", 1)[-1]
        if prefix == "Distributed":
            return "communication op: needs the other ranks"
        if leaf in RANDOM_APIS:
            return "random op: its generator state is not in the dump"
        if leaf in NO_INPUT_APIS:
            return "creation op: no input to check"
        kwargs = self.forward.get("input_kwargs") or {}
        if _has_unknown(self.forward.get("input_args")) or any(_has_unknown(v) for v in kwargs.values()):
            return "an argument the dump could not describe (recorded as {})"
        return None


def _has_unknown(item: Any) -> bool:
    if isinstance(item, list):
        return any(_has_unknown(sub) for sub in item)
    if isinstance(item, dict):
        if not item:
            return True
        if is_tensor_record(item) or "type" in item:
            return False
        return any(_has_unknown(sub) for sub in item.values())
    return False


def selected(api: str, white_list: Iterable[str], black_list: Iterable[str]) -> bool:
    """The predecessor's ``white_list``/``black_list``: names of APIs (``gelu``, or with the prefix
    ``Functional.gelu``); an empty white list selects all."""
    target = api.split(".", 1)[1]
    names = {api, target, target.rsplit(".", 1)[-1]}
    white, black = set(white_list), set(black_list)
    return (not white or bool(names & white)) and not names & black


def dump_cases(dump: RankDump, white_list: Iterable[str] = (), black_list: Iterable[str] = ()) -> Iterator[ApiCase]:
    """The API cases of one rank dump in call order (module entries are not API calls)."""
    white, black = tuple(white_list), tuple(black_list)
    for entry_name, entry in dump.data.items():
        parsed = parse_entry_name(entry_name)
        if parsed is None or parsed.is_module or parsed.phase != "forward" or not isinstance(entry, dict):
            continue
        api = f"{parsed.prefix}.{parsed.target}"
        if not selected(api, white, black):
            continue
        name = f"{api}.{parsed.counter}"
        backward = dump.data.get(f"{name}.backward")
        yield ApiCase(name, api, entry, backward if isinstance(backward, dict) else None, dump)


def find_case(dump: RankDump, api_name: str) -> ApiCase | None:
    """The case of one call, named as in the dump (``Functional.gelu.0.forward``/``.backward``)
    or as in the report (``Functional.gelu.0``); None when the dump has no such call."""
    parsed = parse_entry_name(api_name)
    name = f"{parsed.prefix}.{parsed.target}.{parsed.counter}" if parsed and not parsed.is_module else api_name
    return next((case for case in dump_cases(dump) if case.name == name), None)
