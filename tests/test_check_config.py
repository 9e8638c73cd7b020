"""`check-config`: every error of a config at once (no traceback), and rules that can never
fire on a given model (`--model module:factory`)."""
import json
import subprocess
import sys
from pathlib import Path

from msprobe_engine.cli import main

ROOT = Path(__file__).resolve().parents[1]

BAD = """\
schedul: {}
schedule: {start_step: 10, end_step: 5}
modules: {regex: ["("]}
ring_buffer: 100000000000000000000000000000000000000000000000000000000000000
alerts:
  - rule: spike
    factor: .nan
    metrics: ["%s"]
""" % ("x" * 3000)


def test_every_error_is_listed_at_once(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    assert main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert [e.split(": ")[2] for e in errors] == ["schedul", "schedule.end_step", "modules.regex[0]", "ring_buffer",
                                                 "alerts[0].factor"], err
    assert f"{path}: 5 errors" in err
    assert all(len(line) < 400 for line in errors)


def test_a_predecessor_config_error_is_no_traceback(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"ops": 5, "alert": {"rules": [{"rule_name": "AnomalyTurbulence",
                                                                "args": {"threshold": "x"}}]}}))
    child = subprocess.run([sys.executable, "-m", "msprobe_engine", "check-config", str(path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert child.returncode == 1
    assert "Traceback" not in child.stderr and "error: " in child.stderr
    assert "ops: expected a list, got 5" in child.stderr  # named by the predecessor's own key


def test_rules_that_match_no_tag_of_the_model_are_warned_about(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    path.write_text("watch: {module_outputs: false}\n"
                    "alerts:\n"
                    "  - {rule: spike, metrics: ['train/los']}\n"
                    "  - {rule: trend, metrics: ['actv/*/output*/norm']}\n"
                    "  - {rule: spike, metrics: ['grad/blocks.*.fc.weight/norm']}\n")
    assert main(["check-config", str(path), "--model", "health_models:build"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning: ")]
    assert [w.split()[1] for w in warnings] == ["alerts[0]", "alerts[1]"], captured.err  # alerts[2] can fire
    assert "'train/los'" in warnings[0] and "3 warning(s)" not in captured.out and "2 warning(s)" in captured.out
    assert main(["check-config", str(ROOT / "configs" / "full.yaml"), "--model", "health_models:build"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_dump_config_is_checked_as_one_every_error_naming_its_key(tmp_path, capsys):
    """The predecessor's config.json (a `task`/`dump_path` key) is validated as a dump config."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"task": "overflow_check", "dump_path": str(tmp_path / "d"), "levle": "L1",
                                "step": ["6-4"], "queue_size": 0,
                                "overflow_check": {"overflow_nums": 0, "check_mod": "all"}}))
    assert main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert [e.split(": ")[2].split("[")[0] for e in errors] == [
        "levle", "step", "queue_size", "overflow_check.check_mod", "overflow_check.overflow_nums"], err
    assert "levle: unknown key (did you mean 'level'?)" in errors[0]
    assert f"{path}: 5 errors" in err


def test_a_good_dump_config_says_what_it_dumps(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"task": "tensor", "dump_path": str(tmp_path / "d"), "level": "mix"}))
    assert main(["check-config", str(path)]) == 0
    assert "ok; dump task=tensor, level=mix" in capsys.readouterr().out
