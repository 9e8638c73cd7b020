"""`analyze`: scenes, ignore rules, ordering and the priority lists."""
from __future__ import annotations

import json

import pytest

from dumpgen import build_dump, stat_record, write_dump_json
from msprobe_engine.analysis import analyze, load_ignore_rules
from msprobe_engine.cli import main

NAN, INF = float("nan"), float("inf")
OK = stat_record(1.0, -1.0, 0.0, 2.0)
BAD = stat_record(NAN, -1.0, NAN, NAN)


@pytest.mark.parametrize("task", ["tensor", "statistics"])
def test_injected_nan_is_the_first_critical_and_lists_are_filled(tmp_path, task):
    build_dump(tmp_path, inject_nan_into="layers.2", task=task)
    (result,) = analyze(tmp_path)
    report = result.as_dict()
    assert report["first_critical"] == "Module.layers.2.Linear.forward.0"
    assert report["critical_apis"][0] == "Module.layers.2.Linear.forward.0"
    assert report["high_priority_apis"] == ["Module.layers.3.ReLU.forward.0", "Module.layers.4.Linear.forward.0"]
    orders = [d["order"] for d in report["anomaly_details"]]
    assert orders == sorted(orders) and orders[0] == 2
    assert report["anomaly_details"][0]["bad_outputs"] == ["output.0"]


def test_clean_run_has_no_findings(tmp_path):
    build_dump(tmp_path, task="statistics")
    (result,) = analyze(tmp_path)
    assert result.findings == [] and result.first_critical is None and result.entries == 13


def test_scenes_and_levels(tmp_path):
    data = {
        "Functional.linear.0.forward": {"input_args": [OK], "input_kwargs": {}, "output": [OK]},
        "Functional.gelu.0.forward": {"input_args": [OK], "input_kwargs": {}, "output": [BAD]},
        "Tensor.add.0.forward": {"input_args": [BAD, OK], "input_kwargs": {}, "output": [BAD]},
        "Functional.dropout.0.forward": {"input_args": [OK], "input_kwargs": {"p": BAD}, "output": [OK]},
        "Torch.exp.0.forward": {"input_args": [stat_record(3, 1, 2, 0.5)], "input_kwargs": {},
                                "output": [stat_record(1e4, 2, 1e3, 1e5)]},
        "Functional.gelu.0.backward": {"input": [BAD], "output": [stat_record(1, 0, INF, 1)]},
        "Torch.argmax.0.forward": {"input_args": [OK], "input_kwargs": {},
                                   "output": [stat_record(5, 0, None, None, dtype="torch.int64")]},
    }
    write_dump_json(tmp_path / "step0" / "rank0", data)
    (result,) = analyze(tmp_path)
    assert [(f.entry, f.level, f.scene) for f in result.findings] == [
        ("Functional.gelu.0.forward", "critical", "input_normal_output_bad"),
        ("Tensor.add.0.forward", "high", "input_bad_output_bad"),
        ("Functional.dropout.0.forward", "medium", "input_bad_output_normal"),
        ("Torch.exp.0.forward", "medium", "numerical_mutation"),
        ("Functional.gelu.0.backward", "high", "input_bad_output_bad"),
    ]
    assert result.findings[2].bad_inputs == ["input_kwargs.p"]
    assert "output Norm 100000 > 1000 x input Norm 0.5" in result.findings[3].detail
    (strict,) = analyze(tmp_path, mutation_ratio=1e6)
    assert "Torch.exp.0.forward" not in [f.entry for f in strict.findings]


def test_ignore_rules(tmp_path):
    data = {
        "Torch.empty.0.forward": {"input_args": [], "input_kwargs": {}, "output": [BAD]},
        "Distributed.recv.0.forward": {"input_args": [BAD], "input_kwargs": {}, "output": [OK]},
        "Distributed.recv.1.forward": {"input_args": [OK], "input_kwargs": {"tensor": BAD}, "output": [BAD]},
        "Distributed.all_gather.0.forward": {"input_args": [[BAD, BAD], OK], "input_kwargs": {}, "output": [OK]},
        "Tensor.masked_fill_.0.forward": {"input_args": [BAD, OK, OK], "input_kwargs": {}, "output": [OK]},
        "Tensor.masked_fill_.1.forward": {"input_args": [OK, BAD, OK], "input_kwargs": {}, "output": [OK]},
        "Torch.empty_like.0.forward": {"input_args": [BAD], "input_kwargs": {}, "output": [BAD]},
    }
    write_dump_json(tmp_path / "step0" / "rank0", data)
    (result,) = analyze(tmp_path)
    assert [(f.entry, f.level) for f in result.findings] == [
        ("Distributed.recv.1.forward", "critical"),     # the received data itself is bad
        ("Tensor.masked_fill_.1.forward", "medium"),    # only input 0 is exempt
        ("Torch.empty_like.0.forward", "medium"),       # output exempt, its input still counts
    ]
    assert len(result.ignored) == 7
    assert result.ignored[0].startswith("Torch.empty.0.forward.output.0 (torch.empty:")


def test_user_rules_extend_the_defaults(tmp_path):
    write_dump_json(tmp_path / "d" / "step0" / "rank0",
                    {"Functional.my_init.0.forward": {"input_args": [], "input_kwargs": {}, "output": [BAD]}})
    rules = tmp_path / "rules.yaml"
    rules.write_text("ignore:\n  - api: functional.my_init\n    why: fills later\n    outputs: [0]\n")
    assert analyze(tmp_path / "d")[0].findings[0].level == "critical"
    assert analyze(tmp_path / "d", rules=[rules])[0].findings == []
    assert "torch.empty" in load_ignore_rules([rules]) and "functional.my_init" in load_ignore_rules([rules])


@pytest.mark.parametrize("text,message", [
    ("ignore: {}", "expected a top-level 'ignore:' list"),
    ("ignore:\n  - why: x\n", r"ignore\[0\]: each rule needs 'api"),
    ("ignore:\n  - api: torch.x\n", r"ignore\[0\] \(torch.x\): a rule must list 'inputs' or 'outputs'"),
    ("ignore:\n  - api: torch.x\n    outputs: [a]\n", "'outputs' must list integer indexes"),
    ("ignore: [", "cannot read ignore rules"),
])
def test_bad_rules_file(tmp_path, text, message):
    rules = tmp_path / "rules.yaml"
    rules.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_ignore_rules([rules])


def test_schema_problems_do_not_stop_analysis(tmp_path):
    bad = dict(BAD)
    del bad["Min"]
    write_dump_json(tmp_path / "step0" / "rank0",
                    {"Functional.gelu.0.forward": {"input_args": [OK], "input_kwargs": {}, "output": [bad]}})
    (result,) = analyze(tmp_path)
    assert result.findings[0].level == "critical"
    assert result.problems[0].endswith("data['Functional.gelu.0.forward'].output[0]: missing 'Min'")


def test_cli_analyze_json_and_table(tmp_path, capsys):
    build_dump(tmp_path / "d", inject_nan_into="layers.0", task="statistics")
    assert main(["analyze", str(tmp_path / "d"), "--json", "-"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["first_critical"] == "Module.layers.0.Linear.forward.0"
    assert main(["analyze", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == "first critical: Module.layers.0.Linear.forward.0"
    assert main(["analyze", str(tmp_path / "nowhere")]) == 1
    assert "nowhere: no such directory" in capsys.readouterr().err
