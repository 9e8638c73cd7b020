"""`analyze`: find where a run first went bad, from the statistics in dump.json.

Each entry is classified by whether its input side (input_args, input_kwargs, parameters,
and the incoming gradients of a backward entry) and its output side hold nan/inf:

=========================  ========  =============================================
scene                      level     condition
=========================  ========  =============================================
input_normal_output_bad    critical  no input anomalous, an output anomalous
input_bad_output_bad       high      an input and an output anomalous
input_bad_output_normal    medium    an input anomalous, every output finite
numerical_mutation         medium    all finite, output Norm > ratio x input Norm
=========================  ========  =============================================

Tensors named by an ignore rule do not count. Findings keep execution order.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from msprobe_engine.analysis.predecessor_rules import PREDECESSOR_KEY, from_predecessor
from msprobe_engine.config.yaml_bounded import load_yaml, yaml_problem
from msprobe_engine.dump.reader import DumpError, RankDump, load_dump
from msprobe_engine.dump.schema import TensorRef, has_nonfinite, iter_tensors, parse_entry_name
from msprobe_engine.errors import read_utf8

DEFAULT_RULES = Path(__file__).with_name("ignore_rules.yaml")
MUTATION_RATIO = 1000.0
LEVELS = ("critical", "high", "medium")
PRIORITY_KEYS = {"critical": "critical_apis", "high": "high_priority_apis", "medium": "medium_priority_apis"}


@dataclass(frozen=True, slots=True)
class IgnoreRule:
    """Tensors of one API whose nan/inf are expected."""
    api: str
    why: str = ""
    input_positions: frozenset[int] = frozenset()
    input_names: frozenset[str] = frozenset()
    output_positions: frozenset[int] = frozenset()

    def ignores(self, ref: TensorRef) -> bool:
        """True when this rule leaves ``ref`` out of the check."""
        head = ref.path[0] if ref.path else None
        if ref.role == "input_args":
            return head in self.input_positions
        if ref.role == "input_kwargs":
            return head in self.input_names
        return ref.role == "output" and head in self.output_positions


def _parse_rule(where: str, item: Any) -> IgnoreRule:
    if not isinstance(item, dict) or not isinstance(item.get("api"), str) or not item["api"]:
        raise ValueError(f"{where}: each rule needs 'api: <prefix>.<name>'")
    inputs, outputs = item.get("inputs", []), item.get("outputs", [])
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError(f"{where} ({item['api']}): 'inputs' and 'outputs' must be lists")
    if any(isinstance(o, bool) or not isinstance(o, int) for o in outputs):
        raise ValueError(f"{where} ({item['api']}): 'outputs' must list integer indexes")
    if any(not isinstance(i, (int, str)) or isinstance(i, bool) for i in inputs):
        raise ValueError(f"{where} ({item['api']}): 'inputs' must list indexes or keyword names")
    if not inputs and not outputs:
        raise ValueError(f"{where} ({item['api']}): a rule must list 'inputs' or 'outputs'")
    return IgnoreRule(api=item["api"].lower(), why=str(item.get("why", "")),
                      input_positions=frozenset(i for i in inputs if isinstance(i, int)),
                      input_names=frozenset(i for i in inputs if isinstance(i, str)),
                      output_positions=frozenset(outputs))


def load_ignore_rules(extra: list[Path | str] = ()) -> dict[str, IgnoreRule]:
    """The packaged rules plus those of ``extra`` YAML files (a later rule for the same API wins)."""
    rules: dict[str, IgnoreRule] = {}
    for path in [DEFAULT_RULES, *map(Path, extra)]:
        try:
            doc = load_yaml(read_utf8(path)) or {}  # a byte that is not UTF-8: its error names file, line, column
        except OSError as e:
            raise ValueError(f"{path}: cannot read ignore rules: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: cannot read ignore rules: {yaml_problem(e)}") from None
        items = doc.get("ignore") if isinstance(doc, dict) else None
        if items is None and isinstance(doc, dict) and PREDECESSOR_KEY in doc:  # the predecessor's file
            items = from_predecessor(doc[PREDECESSOR_KEY], path)
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a top-level 'ignore:' list")
        for i, item in enumerate(items):
            rule = _parse_rule(f"{path}: ignore[{i}]", item)
            rules[rule.api] = rule
    return rules


@dataclass(frozen=True, slots=True)
class Finding:
    """One anomalous entry."""
    order: int
    entry: str
    level: str
    scene: str
    bad_inputs: list[str]
    bad_outputs: list[str]
    detail: str = ""


@dataclass
class RankAnalysis:
    """Findings of one rank directory, in execution order."""
    path: str
    step: int | None
    rank: int | None
    entries: int
    findings: list[Finding] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def first_critical(self) -> Finding | None:
        return next((f for f in self.findings if f.level == "critical"), None)

    def as_dict(self) -> dict[str, Any]:
        first = self.first_critical
        out: dict[str, Any] = {"path": self.path, "step": self.step, "rank": self.rank, "entries": self.entries,
                               "first_critical": first.entry if first else None}
        for level, key in PRIORITY_KEYS.items():
            out[key] = [f.entry for f in self.findings if f.level == level]
        out["anomaly_details"] = [asdict(f) for f in self.findings]
        out["ignored"] = self.ignored
        out["problems"] = self.problems
        return out


def _max_norm(refs: list[TensorRef]) -> float | None:
    norms = [n for n in (r.stat("Norm") for r in refs) if n is not None and math.isfinite(n)]
    return max(norms) if norms else None


def classify(order: int, name: str, entry: dict[str, Any], rules: dict[str, IgnoreRule],
             mutation_ratio: float = MUTATION_RATIO) -> tuple[Finding | None, list[str]]:
    """The finding for one entry (or None) and the labels of tensors an ignore rule left out."""
    parsed = parse_entry_name(name)
    rule = rules.get(parsed.api_name) if parsed and not parsed.is_module else None
    inputs, outputs, ignored = [], [], []
    for ref in iter_tensors(name, entry):
        if rule is not None and rule.ignores(ref):
            if has_nonfinite(ref):
                ignored.append(f"{name}.{ref.label} ({rule.api}: {rule.why})")
            continue
        (inputs if ref.is_input else outputs).append(ref)
    bad_in = [r.label for r in inputs if has_nonfinite(r)]
    bad_out = [r.label for r in outputs if has_nonfinite(r)]
    if bad_out:
        level, scene = ("high", "input_bad_output_bad") if bad_in else ("critical", "input_normal_output_bad")
        return Finding(order, name, level, scene, bad_in, bad_out), ignored
    if bad_in:
        return Finding(order, name, "medium", "input_bad_output_normal", bad_in, []), ignored
    in_norm, out_norm = _max_norm(inputs), _max_norm(outputs)
    if in_norm and out_norm is not None and out_norm > mutation_ratio * in_norm:
        detail = f"output Norm {out_norm:.6g} > {mutation_ratio:g} x input Norm {in_norm:.6g}"
        return Finding(order, name, "medium", "numerical_mutation", [], [], detail), ignored
    return None, ignored


def analyze_rank(dump: RankDump, rules: dict[str, IgnoreRule], mutation_ratio: float = MUTATION_RATIO) -> RankAnalysis:
    """Classify every entry of one rank dump."""
    result = RankAnalysis(str(dump.path), dump.step, dump.rank, len(dump.data), problems=list(dump.problems))
    for order, (name, entry) in enumerate(dump.data.items()):
        if not isinstance(entry, dict):
            continue
        finding, ignored = classify(order, name, entry, rules, mutation_ratio)
        result.ignored += ignored
        if finding is not None:
            result.findings.append(finding)
    return result


def analyze(path: Path | str, rules: list[Path | str] = (), mutation_ratio: float = MUTATION_RATIO) -> list[RankAnalysis]:
    """Analyze every rank directory under ``path``; ``rules`` are extra ignore-rule YAML files.

    Schema problems do not stop the analysis: they are listed in ``RankAnalysis.problems``.
    Raises ``DumpError`` for a missing directory or an unreadable dump.json, ``ValueError``
    for a bad rules file.
    """
    loaded_rules = load_ignore_rules(list(rules))
    dumps = load_dump(path, strict=False)
    if not dumps:
        raise DumpError(f"{path}: no dump found")
    return [analyze_rank(d, loaded_rules, mutation_ratio) for d in dumps.values()]
