"""Every key of the predecessor's documented dump configs is mapped or refused naming the replacement.

The documented keys are extracted from its documentation (/work/shared/reference/, when present)
and kept in `DOCUMENTED` (the test fails when the documentation names a key this list lacks),
together with keys of its 1.1.x releases that later docs removed (the online pre-check's
``nfs_path``/``host``/``port``...). Each loads at its documented default; at another value it
loads or is refused with a message naming the key and what to use, never "unknown key". Its
example configs (tests/fixtures/predecessor_configs/) load, and its ignore-rule file is read.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from msprobe_engine.analysis.overflow import load_ignore_rules
from msprobe_engine.analysis.precheck.runner import load_precheck_config
from msprobe_engine.errors import ConfigError
from msprobe_engine.dump import load_dump_config

REFERENCE = Path("/work/shared/reference/003_1db071c6eb59a882.txt")
CONFIGS = Path(__file__).resolve().parent / "fixtures" / "predecessor_configs"
THEIR_RULES = Path("/work/main/.venv/lib/python3.11/site-packages/msprobe/core/overflow_check/ignore_rules.yaml")

#: key -> (where it goes: "" top level, else the task whose section holds it; its documented
#: default; another documented value)
DOCUMENTED: dict[str, tuple[str, object, object]] = {
    "task": ("", "statistics", "tensor"),
    "dump_path": ("", "./dump_path", "/home/data_dump"),
    "rank": ("", [], [1, "4-6"]),
    "step": ("", [], [0, 1, 2, "4-6"]),
    "level": ("", "L1", "L2"),
    "acl_config": ("", None, "./acl_config.json"),
    "enable_dataloader": ("", False, True),
    "is_deterministic": ("", False, True),
    "async_dump": ("", False, True),
    "precision": ("", "high", "low"),
    "extra_info": ("", True, False),
    "framework": ("", "pytorch", "mindspore"),
    "statistics": ("", {}, {"scope": []}),
    "tensor": ("", {}, {"list": []}),
    "run_ut": ("", {}, {"white_list": []}),
    "overflow_check": ("", {}, {"overflow_nums": 1}),
    "free_benchmark": ("", {}, {"pert_mode": "add_noise"}),
    "scope": ("statistics", [], ["Tensor.add.0.forward", "Functional.square.2.forward"]),
    "list": ("statistics", [], ["relu"]),
    "data_mode": ("statistics", ["all"], ["forward", "input"]),
    "summary_mode": ("statistics", "statistics", "md5"),
    "backward_input": ("tensor", [], ["./npu_dump/step0/rank0/Functional.conv2d.1.backward.input.0.pt"]),
    "file_format": ("tensor", "npy", "bin"),
    "online_run_ut": ("tensor", False, True),
    "online_run_ut_recompute": ("tensor", False, True),
    "nfs_path": ("tensor", "", "/nfs/precheck"),
    "host": ("tensor", "", "127.0.0.1"),
    "port": ("tensor", -1, 8765),
    "tls_path": ("tensor", "", "./tls"),
    "white_list": ("run_ut", [], ["conv2d"]),
    "black_list": ("run_ut", [], ["dropout"]),
    "error_data_path": ("run_ut", "./", "./errors"),
    "overflow_nums": ("overflow_check", 1, -1),
    "check_mode": ("overflow_check", "all", "aicore"),
    "pert_mode": ("free_benchmark", "improve_precision", "add_noise"),
    "handler_type": ("free_benchmark", "check", "fix"),
    "fuzz_level": ("free_benchmark", "L1", "L1"),
    "fuzz_stage": ("free_benchmark", "forward", "backward"),
    "fuzz_device": ("free_benchmark", "npu", "cpu"),
    "if_preheat": ("free_benchmark", False, True),
    "preheat_step": ("free_benchmark", 15, 10),
    "max_sample": ("free_benchmark", 20, 10),
    "grad_level": ("grad_probe", "L1", "L2"),
    "param_list": ("grad_probe", [], ["fc.weight"]),
    "bounds": ("grad_probe", [-1, 0, 1], [-10, 0, 10]),
}


def documented_keys(text: str) -> set[str]:
    """The keys named in the first column of its config tables (the rows with a required yes/no
    column) and in its example configs."""
    intro = text.split("msprobe/docs/02.config_introduction.md", 1)[1].split("\nmsprobe/docs/03", 1)[0]
    keys = set()
    for line in intro.splitlines():
        body = line[1:] if line[:1] in "+- " else line
        row = (re.match(r"\s*\|\s*([a-z_]+)\s*(?:<sup>\w*</sup>)?\s*\|.*\|\s*(?:是|否)\s*\|\s*$", body)
               or re.match(r"\s*<tr><td(?: [^>]*)?>([a-z_]+)</td>", body))
        if row:
            keys.add(row.group(1))
    examples = text.split("msprobe/docs/03.config_examples.md", 1)[1]
    return keys | set(re.findall(r'^[+ -]\s*"([a-z_]+)":', examples, flags=re.M))


@pytest.mark.skipif(not REFERENCE.is_file(), reason="the predecessor's documentation is not on this machine")
def test_every_key_of_its_documentation_is_listed_here():
    found = documented_keys(REFERENCE.read_text(encoding="utf-8"))
    assert len(found) > 25
    assert not found - set(DOCUMENTED), f"documented keys without a case here: {sorted(found - set(DOCUMENTED))}"


def _config(key: str, value: object, tmp_path: Path) -> dict:
    where = DOCUMENTED[key][0]
    task = where if where and where not in ("run_ut",) else "statistics"
    data: dict = {"dump_path": str(tmp_path), "task": task}
    if task == "free_benchmark" and key in ("preheat_step", "max_sample"):
        data[task] = {"if_preheat": value != DOCUMENTED[key][1]}
    if task == "free_benchmark" and key == "fuzz_device" and value == "cpu":
        data[task] = {"pert_mode": "to_cpu"}
    if where:
        data.setdefault(where, {})[key] = value
        if where == "tensor":
            data["task"] = "tensor"
    else:
        data[key] = value
    if key == "task":
        data["task"] = value
    return data


@pytest.mark.parametrize("key", sorted(DOCUMENTED))
def test_each_documented_key_loads_at_its_default(key, tmp_path):
    if DOCUMENTED[key][0] == "run_ut":
        file = tmp_path / "run_ut.json"
        file.write_text(json.dumps({"run_ut": {key: DOCUMENTED[key][1]}}))
        load_precheck_config(file)
        return
    load_dump_config(_config(key, DOCUMENTED[key][1], tmp_path))


@pytest.mark.parametrize("key", sorted(DOCUMENTED))
def test_each_documented_key_at_another_value_loads_or_names_what_to_use(key, tmp_path):
    value = DOCUMENTED[key][2]
    if DOCUMENTED[key][0] == "run_ut":
        file = tmp_path / "run_ut.json"
        file.write_text(json.dumps({"run_ut": {key: value}}))
        load_precheck_config(file)
        return
    try:
        load_dump_config(_config(key, value, tmp_path))
    except ConfigError as err:
        message = str(err)
        assert "unknown key" not in message
        assert key in message or repr(value) in message or str(value) in message, message
        assert re.search(r"\buse\b|instead|only|accepted|supported", message), message


@pytest.mark.parametrize("name", ["statistics", "tensor", "tensor_online_off", "overflow_check", "free_benchmark",
                                  "grad_probe"])
def test_its_example_configs_load(name):
    config = load_dump_config(CONFIGS / f"{name}.json")
    assert config.task == json.loads((CONFIGS / f"{name}.json").read_text())["task"]


def test_its_free_benchmark_example_keeps_preheat_off():
    options = load_dump_config(CONFIGS / "free_benchmark.json").options
    assert options.if_preheat is False and options.pert_mode == "improve_precision"


def test_its_run_ut_example_configures_the_precheck_and_the_dump_says_so():
    assert load_precheck_config(CONFIGS / "run_ut.json").white_list == ()
    with pytest.raises(ConfigError, match=r"task: 'run_ut' .*msprobe-engine run_ut -i <dump> --config"):
        load_dump_config(CONFIGS / "run_ut.json")


def test_its_kernel_dump_example_is_refused_naming_what_to_use():
    with pytest.raises(ConfigError, match=r"acl_config: .*kernel-level \(L2\) dumps .* use|level L1 or mix"):
        load_dump_config(CONFIGS / "kernel_l2.json")


def test_online_run_ut_on_names_the_online_precheck(tmp_path):
    with pytest.raises(ConfigError, match=r"tensor.online_run_ut: True .*OnlinePrecheck"):
        load_dump_config({"dump_path": str(tmp_path), "task": "tensor", "tensor": {"online_run_ut": True}})


@pytest.mark.skipif(not THEIR_RULES.is_file(), reason="the predecessor is not installed")
def test_its_ignore_rule_file_reads_as_its_filter_reads_it():
    from msprobe.core.overflow_check.filter import IgnoreFilter

    theirs = IgnoreFilter(str(THEIR_RULES)).rules
    ours = load_ignore_rules([THEIR_RULES])
    for api, rule in theirs.items():
        mine = ours[api.lower()]
        assert mine.input_positions == frozenset(rule.input_ignore.index), api
        assert mine.input_names == frozenset(rule.input_ignore.name), api
        assert mine.output_positions == frozenset(rule.output_ignore.index), api
    assert len(theirs) >= 5


def test_a_bad_rule_in_its_schema_names_the_rule(tmp_path):
    file = tmp_path / "rules.yaml"
    file.write_text("ignore_nan_inf:\n  - api_name: torch.empty\n    output_ignore: 3\n")
    with pytest.raises(ValueError, match=r"ignore_nan_inf\[0\].output_ignore"):
        load_ignore_rules([file])
