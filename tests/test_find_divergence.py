"""`compare A B --find-divergence`: the first call where two dumps part (execution order), and the
first step and tag where two monitor runs do, on a model whose third layer was changed in B."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from msprobe_engine.analysis.divergence import first_dump_divergence, first_run_divergence
from msprobe_engine.cli import main
from msprobe_engine.dump import PrecisionDebugger
from tests.monitor_run_helpers import monitored_run


def _model(changed: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    if changed:
        with torch.no_grad():
            model[2].weight[0, 0] += 0.05
    return model


def _dump(path, level: str, changed: bool):
    model = _model(changed)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with PrecisionDebugger({"dump_path": str(path), "level": level, "strict": True}) as debugger:
        debugger.start(model)
        model(x).sum().backward()
        debugger.stop()
        debugger.step()
    return path


@pytest.mark.parametrize("level,entry,inside,weight", [
    ("L1", "Functional.linear.1.forward", [], "input_args.1"),
    ("mix", "Functional.linear.1.forward", ["Module.2.Linear.forward.0"], "input_args.1"),
    ("L0", "Module.2.Linear.forward.0", [], "parameters.weight"),
])
def test_first_divergent_call_of_two_dumps(tmp_path, level, entry, inside, weight):
    a, b = _dump(tmp_path / "a", level, False), _dump(tmp_path / "b", level, True)
    assert first_dump_divergence(a, a) is None
    found = first_dump_divergence(a, b)
    assert (found.step, found.entry, found.inside, found.inputs_differ) == (0, entry, inside, [weight])
    assert found.tensor.startswith("output") and found.rel_diff > 1e-3
    assert main(["compare", str(a), str(b), "--find-divergence", "--json", str(tmp_path / "d.json")]) == 0
    assert json.loads((tmp_path / "d.json").read_text())["entry"] == entry


def test_an_input_changed_outside_the_dump_is_named(tmp_path):
    a = _dump(tmp_path / "a", "L1", False)
    model = _model(False)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with PrecisionDebugger({"dump_path": str(tmp_path / "b"), "level": "L1", "strict": True}) as debugger:
        h = model[1](model[0](x))
        debugger.start(model)
        h = h.detach() * 1.1  # before the dump: its first call sees a different activation
        model[4](model[3](model[2](h))).sum().backward()
        debugger.stop()
        debugger.step()
    found = first_dump_divergence(a, tmp_path / "b")
    assert found.inputs_differ and found.inputs_differ[0] == "input_args.0"


def test_a_tolerance_above_the_change_finds_none(tmp_path):
    a, b = _dump(tmp_path / "a", "L1", False), _dump(tmp_path / "b", "L1", True)
    assert first_dump_divergence(a, b, rtol=0.5) is None


def _run(out, changed: bool):
    g = torch.Generator().manual_seed(1)
    return monitored_run(_model(changed), {"output_dir": str(out), "run_name": "run", "sinks": ["jsonl"], "strict": True,
                                           "watch": {"module_outputs": True, "param_grads": True}},
                         [torch.randn(3, 4, generator=g) for _ in range(2)])


def test_first_divergent_tag_of_two_runs_names_its_module(tmp_path, capsys):
    a, b = _run(tmp_path / "a", False), _run(tmp_path / "b", True)
    found = first_run_divergence(a, b)
    assert (found.step, found.module) == (0, "2") and found.entry.startswith("actv/2/")
    assert main(["compare", str(a), str(b), "--find-divergence"]) == 0
    assert "step 0 rank 0: actv/2/" in capsys.readouterr().out
