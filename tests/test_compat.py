"""`msprobe_engine.compat`: the predecessor's PyTorch API with one import line changed.

The predecessor's documented usage examples (tests/fixtures/predecessor_examples/) run in child
processes twice: as written (mindstudio-probe 26.2) and with only ``from msprobe.pytorch import``
replaced by ``from msprobe_engine.compat import``; both write the same files and names. Then
the calls one by one, in this process: the singleton, save's records, module_dump, seed_all,
TrainerMon's steps, and that the training's numbers do not change.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from msprobe_engine.compat import PrecisionDebugger, TrainerMon, module_dump, module_dump_end, seed_all
from msprobe_engine.errors import ConfigError
from tests.compat_helpers import run_example as _run_example, same_records as _same_records, step_documents as _steps

ROOT = Path(__file__).resolve().parents[1]


# ---- the documented examples, with one import changed ------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name,config", [
    ("dump_l1.py", {"task": "statistics", "level": "L1", "step": [], "rank": [],
                    "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}),
    ("module_dump.py", {"task": "statistics", "level": "L1"}),
    ("faq_start_no_model.py", None),
])
def test_dump_examples_write_what_the_predecessor_writes(tmp_path, name, config):
    theirs = _steps(_run_example(name, tmp_path, ours=False, config=config)[0])
    ours = _steps(_run_example(name, tmp_path, ours=True, config=config)[0])
    assert list(ours) == list(theirs) and theirs
    if name == "faq_start_no_model.py":  # ours also sees the relu imported by name (a torch function
        # mode replaces nothing), so the predecessor's only call, torch.relu, is our second
        data = ours["step0"]["data"]
        assert list(data) == ["Torch.relu.0.forward", "Torch.relu.1.forward"]
        assert list(theirs["step0"]["data"]) == ["Torch.relu.0.forward"]
        _same_records(data["Torch.relu.1.forward"], theirs["step0"]["data"]["Torch.relu.0.forward"], "relu")
        return
    for step, document in theirs.items():
        assert {k: v for k, v in ours[step].items() if k != "data"} == {k: v for k, v in document.items()
                                                                       if k != "data"}
        missing = [entry for entry in document["data"] if entry not in ours[step]["data"]]
        assert not missing, f"{step}: entries of the predecessor missing from ours: {missing}"
        for entry, record in document["data"].items():
            _same_records(ours[step]["data"][entry], record, f"{step}/{entry}")
    if name == "module_dump.py":  # the module as a unit, and none of the APIs inside it
        names = list(ours["step0"]["data"])
        assert "Module.MyModuleDump.Linear.forward.0" in names and "Module.MyModuleDump.Linear.backward.0" in names
        assert names == list(theirs["step0"]["data"])


@pytest.mark.slow
def test_debug_save_example_writes_the_predecessors_debug_json(tmp_path):
    theirs = _steps(_run_example("debug_save.py", tmp_path, ours=False)[0], "debug.json")
    ours = _steps(_run_example("debug_save.py", tmp_path, ours=True)[0], "debug.json")
    assert list(ours) == list(theirs) == ["step0", "step1"]
    for step in theirs:
        assert list(ours[step]["data"]) == list(theirs[step]["data"]) == [
            "hidden.0.debug", "hidden_grad.0.debug", "result.0.debug", "result_grad.0.debug", "result.1.debug"]
        _same_records(ours[step], theirs[step], step)


@pytest.mark.slow
def test_trainer_mon_example_trains_the_same_and_records_every_step(tmp_path):
    config = json.loads((ROOT / "configs" / "predecessor_monitor.json").read_text())
    config["format"] = "csv"
    _, their_out = _run_example("trainer_mon.py", tmp_path, ours=False, config=config, dump_config=False)
    dump_path, our_out = _run_example("trainer_mon.py", tmp_path, ours=True, config=config, dump_config=False)
    losses = [line for line in our_out.splitlines() if line.startswith("LOSSES")]
    assert losses and losses == [line for line in their_out.splitlines() if line.startswith("LOSSES")]
    rows = list(csv.DictReader((dump_path / "rank0" / "metrics.csv").open()))
    steps = sorted({int(r["step"]) for r in rows})
    assert steps == [0, 1, 2]
    tags = {r["tag"] for r in rows}
    assert {"grad/layers.0.weight/norm", "optim/layers.1.weight/exp_avg/norm"} <= tags


@pytest.mark.slow
def test_trainer_mon_mg_direction_is_the_predecessors(tmp_path):
    """Its monitor config with ``mg_direction: true``: its per-parameter values (its "other" CSV
    files, 6 digits) are ours (`watch.health.mg_direction`) from the second step on."""
    config = {**json.loads((ROOT / "configs" / "predecessor_monitor.json").read_text()), "format": "csv",
              "mg_direction": True}
    their_out, _ = _run_example("trainer_mon.py", tmp_path, ours=False, config=config, dump_config=False)
    dump_path, _ = _run_example("trainer_mon.py", tmp_path, ours=True, config=config, dump_config=False)
    theirs = {}
    for file in their_out.glob("*/other_*.csv"):
        for row in csv.DictReader(file.open()):
            theirs[int(row["step"]), row["name"]] = float(row["norm"])
    ours = {(int(r["step"]), r["tag"].split("/")[1]): float(r["value"])
            for r in csv.DictReader((dump_path / "rank0" / "metrics.csv").open())
            if r["tag"].endswith("/mg_direction/norm")}
    assert sorted(ours) == sorted(key for key in theirs if key[0] > 0) and len(ours) == 8
    assert all(theirs[key] == 1.0 for key in theirs if key[0] == 0)  # its first step: 1.0 by definition
    for key, value in ours.items():
        assert value == pytest.approx(theirs[key], abs=1e-6), key
    assert len({round(v, 6) for v in ours.values()}) > 2  # not a constant


# ---- the calls, in this process ------------------------------------------------------------------
@pytest.fixture
def fresh():
    PrecisionDebugger._forget()
    yield
    PrecisionDebugger._forget()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_one_debugger_per_process_and_class_calls(tmp_path, fresh):
    first = PrecisionDebugger(dump_path=str(tmp_path), level="L1")
    assert PrecisionDebugger(dump_path="elsewhere") is first  # the predecessor's singleton
    model = _model()
    x = torch.randn(2, 4)
    PrecisionDebugger.start(model)
    model(x).sum().backward()
    PrecisionDebugger.stop()
    PrecisionDebugger.step()
    first.close()
    names = list(_steps(tmp_path)["step0"]["data"])
    assert "Functional.linear.0.forward" in names and "Functional.linear.1.backward" in names


def test_calls_before_a_debugger_exists_are_an_error(fresh):
    with pytest.raises(ConfigError, match="PrecisionDebugger must be created"):
        PrecisionDebugger.step()
    with pytest.raises(ConfigError, match="PrecisionDebugger must be created"):
        module_dump(nn.Linear(1, 1), "x")


def test_start_refuses_inference_options_naming_them(tmp_path, fresh):
    PrecisionDebugger(dump_path=str(tmp_path))
    with pytest.raises(ConfigError, match="token_range"):
        PrecisionDebugger.start(token_range=[0, 4])


def test_save_outside_debug_level_or_dumped_steps_writes_nothing(tmp_path, fresh):
    debugger = PrecisionDebugger(dump_path=str(tmp_path / "l1"), level="L1")
    debugger.save(torch.ones(2), "x")
    debugger.step()
    debugger.close()
    assert not list((tmp_path / "l1").rglob("debug.json"))
    PrecisionDebugger._forget()
    debugger = PrecisionDebugger(dump_path=str(tmp_path / "dbg"), level="debug", step=[1])
    for value in (1.0, 2.0):
        debugger.save(torch.full((2,), value), "x")
        debugger.step()
    debugger.close()
    (only,) = (tmp_path / "dbg").rglob("debug.json")
    assert only.parent.parent.name == "step1"
    assert json.loads(only.read_text())["data"]["x.0.debug"]["Max"] == 2.0


def test_save_checks_its_arguments(tmp_path, fresh):
    PrecisionDebugger(dump_path=str(tmp_path), level="debug")
    with pytest.raises(ConfigError, match="save"):
        PrecisionDebugger.save(torch.ones(1), 3)


def test_save_with_task_tensor_saves_the_tensors(tmp_path, fresh):
    debugger = PrecisionDebugger(dump_path=str(tmp_path), level="debug", task="tensor")
    value = torch.arange(6.0).reshape(2, 3)
    debugger.save(value, "v", save_backward=False)
    debugger.step()
    debugger.close()
    (file,) = tmp_path.rglob("debug.json")
    record = json.loads(file.read_text())["data"]["v.0.debug"]
    saved = torch.load(file.parent / "dump_tensor_data" / record["data_name"], weights_only=True)
    assert torch.equal(saved, value)


def test_module_dump_leaves_training_bitwise_unchanged(tmp_path, fresh):
    def run(dump: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = _model()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        if dump:
            PrecisionDebugger.start(model)
            module_dump(model[0], "first")
        h = model[0](x)
        if dump:
            module_dump_end()
        loss = model[2](model[1](h)).pow(2).mean()
        loss.backward()
        if dump:
            PrecisionDebugger.stop()
            PrecisionDebugger.step()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain = run(False)
    PrecisionDebugger(dump_path=str(tmp_path), level="L1")
    dumped = run(True)
    assert torch.equal(plain[0], dumped[0]) and all(torch.equal(a, b) for a, b in zip(plain[1], dumped[1]))
    PrecisionDebugger._instance.close()
    names = list(_steps(tmp_path)["step0"]["data"])
    assert names[0] == "Module.first.Linear.forward.0"
    assert not any(n.startswith("Functional.linear.0") and "first" not in n for n in names[:1])
    assert "Module.first.Linear.parameters_grad.0" in names


def test_seed_all_repeats_every_generator_and_checks_its_arguments():
    import random

    import numpy as np

    draws = []
    for _ in range(2):
        seed_all(7)
        draws.append((random.random(), float(np.random.rand()), torch.rand(1).item()))
    assert draws[0] == draws[1]
    with pytest.raises(ConfigError, match="seed"):
        seed_all(-1)
    with pytest.raises(ConfigError, match="mode"):
        seed_all(1, mode="yes")


def test_seed_all_mode_and_rm_dropout(monkeypatch):
    import torch.nn.functional as F

    for name in ("dropout", "dropout2d"):
        monkeypatch.setattr(F, name, getattr(F, name))  # undone after the test
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    try:
        seed_all(3, mode=True, rm_dropout=True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        x = torch.ones(1000)
        assert torch.equal(nn.Dropout(0.5).train()(x), x)
        assert torch.equal(F.dropout(x, 0.9, True), x)
    finally:
        torch.use_deterministic_algorithms(False)


def test_trainer_mon_takes_both_argument_orders_and_closes_each_step(tmp_path):
    for order in ("26.x", "1.x"):
        out = tmp_path / order
        config = tmp_path / f"{order}.json"
        config.write_text(json.dumps({"targets": {"0": {}}, "wg_distribution": True, "format": "csv",
                                      "ops": ["norm"], "output_dir": str(out)}))
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = TrainerMon(str(config))
        if order == "26.x":
            mon.set_monitor(model, opt, 2)
        else:
            mon.set_monitor(model, 2, opt)
        for step in range(2):
            for _micro in range(2):
                model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            assert mon.monitor.monitor.step == step + 1  # closed by the optimizer's step
        mon.close()
        rows = list(csv.DictReader((out / "rank0" / "metrics.csv").open()))
        assert sorted({int(r["step"]) for r in rows}) == [0, 1]
        assert any(r["tag"] == "grad/0.weight/norm" for r in rows)


@pytest.mark.parametrize("args,message", [
    ((None, 1), "optimizer"),
    ("opt", "grad_acc_steps"),
])
def test_trainer_mon_bad_arguments_are_named(tmp_path, args, message):
    config = tmp_path / "m.json"
    config.write_text(json.dumps({"targets": {"0": {}}, "output_dir": str(tmp_path)}))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    call = (opt, 0) if args == "opt" else args
    with pytest.raises(ConfigError, match=message):
        TrainerMon(str(config)).set_monitor(model, *call)
