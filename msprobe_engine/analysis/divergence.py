"""`compare A B --find-divergence`: the first call (module or API) where two dumps part, or the
first step and tag where two monitor runs do.

Dumps: the (step, rank) directories of both, in order; in each, the entries of A in dump.json
order (execution order: an entry is written when its call completes, so a module comes after
the calls inside it) are matched by name in B, and the first entry one of whose outputs
(for a backward entry: the gradients it produced; ``parameters_grad``: the gradients) has a
Max/Min/Mean/Norm differing beyond the tolerance (`runs.relative_difference`: both rtol and
atol exceeded, or nan/inf classes differ) is the divergence. It reports which of that entry's
inputs (arguments, parameters) differ too: none means the divergence starts in this call; a
parameter means the weights differ; an activation, that something not recorded changed it.
And the modules the entry ran inside (construct.json), outermost first.
Monitor runs: `runs.compare_runs`'s first divergence, with the module its tag names.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from msprobe_engine.analysis.runs import ATOL, RTOL, compare_runs, is_run, relative_difference
from msprobe_engine.dump.reader import RankDump, load_dump
from msprobe_engine.dump.schema import STAT_KEYS, TensorRef, iter_tensors


@dataclass(frozen=True)
class FirstDivergence:
    """Where B first departs from A."""
    step: int | None
    rank: int | None
    entry: str                       # a dump entry, or a monitor tag
    tensor: str = ""                 # output.0, parameters_grad.weight...
    stat: str = ""
    a: float | None = None
    b: float | None = None
    rel_diff: float = 0.0
    inputs_differ: list[str] = field(default_factory=list)  # dumps: the entry's inputs that differ too
    inside: list[str] = field(default_factory=list)  # dumps: enclosing modules, outermost first
    module: str = ""                 # runs: the module (or parameter) path of the tag


def _differs(a: float | None, b: float | None, rtol: float, atol: float) -> bool:
    if a is None or b is None:
        return (a is None) != (b is None)
    rel = relative_difference(a, b)
    return rel > rtol and (math.isinf(rel) or abs(b - a) > atol)


def _first_stat(ref_a: TensorRef, ref_b: TensorRef, rtol: float, atol: float) -> str | None:
    return next((k for k in STAT_KEYS if _differs(ref_a.stat(k), ref_b.stat(k), rtol, atol)), None)


def _enclosing(dump: RankDump, entry: str) -> list[str]:
    parents, seen = [], {entry}
    construct = dump.construct()
    node = construct.get(entry)
    while isinstance(node, str) and node not in seen:
        parents.append(node)
        seen.add(node)
        node = construct.get(node)
    return parents[::-1]


def _in_rank(a: RankDump, b: RankDump, rtol: float, atol: float) -> FirstDivergence | None:
    for name, entry_a in a.data.items():
        entry_b = b.data.get(name)
        if not isinstance(entry_a, dict) or not isinstance(entry_b, dict):
            continue
        refs_b = {ref.label: ref for ref in iter_tensors(name, entry_b)}
        inputs_differ = []
        for ref in iter_tensors(name, entry_a):
            other = refs_b.get(ref.label)
            stat = _first_stat(ref, other, rtol, atol) if other is not None else None
            if stat is None:
                continue
            if ref.is_input:
                inputs_differ.append(ref.label)
                continue
            va, vb = ref.stat(stat), other.stat(stat)
            rel = relative_difference(va, vb) if va is not None and vb is not None else math.inf
            return FirstDivergence(a.step, a.rank, name, ref.label, stat, va, vb, rel, inputs_differ,
                                   _enclosing(a, name))
    return None


def first_dump_divergence(a: Path | str, b: Path | str, rtol: float = RTOL, atol: float = ATOL) -> FirstDivergence | None:
    """The first entry whose outputs differ (see the module docstring), or None."""
    dumps_a, dumps_b = load_dump(a), load_dump(b)
    if not set(dumps_a) & set(dumps_b):
        raise ValueError(f"{a} and {b} share no (step, rank) directory")
    for key in sorted(set(dumps_a) & set(dumps_b), key=lambda k: (k[0] if k[0] is not None else -1,
                                                                    k[1] if k[1] is not None else -1)):
        found = _in_rank(dumps_a[key], dumps_b[key], rtol, atol)
        if found is not None:
            return found
    return None


def first_run_divergence(a: Path | str, b: Path | str, rtol: float = RTOL, atol: float = ATOL) -> FirstDivergence | None:
    """The first step and tag where two monitor runs differ, with the module path of the tag."""
    first = compare_runs(a, b, rtol=rtol, atol=atol).first
    if first is None:
        return None
    parts = first.tag.split("/")
    return FirstDivergence(first.step, first.rank, first.tag, a=first.a, b=first.b, rel_diff=first.rel_diff,
                           module=parts[1] if len(parts) > 2 else "")


def format_divergence(found: FirstDivergence | None) -> str:
    if found is None:
        return "find-divergence: no divergence beyond the tolerance"
    where = f"step {found.step}" + (f" rank {found.rank}" if found.rank is not None else "")
    if found.module or not found.tensor:
        return (f"find-divergence: {where}: {found.entry} ({found.module or 'run-level'}): "
                f"{found.a!r} | {found.b!r} (rel {found.rel_diff:.3g})")
    start = (f"inputs that differ too: {', '.join(found.inputs_differ)}" if found.inputs_differ else
             "its inputs agree: the divergence starts in this call")
    path = " > ".join(found.inside + [found.entry])
    return (f"find-divergence: {where}: {path}\n  {found.tensor} {found.stat}: {found.a!r} | {found.b!r} "
            f"(rel {found.rel_diff:.3g}); {start}")


def run(args: argparse.Namespace) -> int:
    """The `compare --find-divergence` branch: prints the first divergence (exit 0 either way)."""
    finder = first_run_divergence if is_run(args.a) and is_run(args.b) else first_dump_divergence
    found = finder(args.a, args.b, rtol=args.rtol, atol=args.atol)
    if args.json != "-":
        print(format_divergence(found))
    if args.json:
        text = json.dumps(asdict(found) if found else None, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text, encoding="utf-8")
    return 0
