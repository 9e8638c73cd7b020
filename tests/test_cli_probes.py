"""Hostile inputs against every CLI verb: each ends in one line on stderr naming the file
(exit 1), a bad argument in argparse's usage error (exit 2); never a traceback, never a silent
all-clear. Inputs are hand-written corruptions of small dumps and runs (fast, no training)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dumpgen import stat_record, write_dump_json
from msprobe_engine.cli import main

API = "Functional.relu.0.forward"


def _entry(max_: float = 1.0) -> dict:
    return {"input_args": [stat_record(max_, -1.0, 0.0, 2.0)], "output": [stat_record(max_, 0.0, 0.5, 1.5)]}


def _good(root: Path) -> Path:
    return write_dump_json(root / "step0" / "rank0", {API: _entry(), "Functional.gelu.0.forward": _entry()})


def _raw_dump(root: Path, text: str | bytes) -> Path:
    rank = root / "step0" / "rank0"
    rank.mkdir(parents=True)
    (rank / "dump.json").write_bytes(text.encode() if isinstance(text, str) else text)
    return root


def _with_entry(root: Path, entry: object, name: str = API) -> Path:
    write_dump_json(root / "step0" / "rank0", {name: entry, "Functional.gelu.0.forward": _entry()})
    return root


def _tensor_dump(root: Path, content: bytes) -> Path:
    rank = root / "step0" / "rank0"
    (rank / "dump_tensor_data").mkdir(parents=True)
    rec = stat_record(1.0, -1.0, 0.0, 2.0, data_name=f"{API}.input.0.pt")
    out = stat_record(1.0, 0.0, 0.5, 1.5, data_name=f"{API}.output.0.pt")
    (rank / "dump_tensor_data" / rec["data_name"]).write_bytes(content)
    torch.save(torch.ones(2, 2), rank / "dump_tensor_data" / out["data_name"])
    write_dump_json(rank, {API: {"input_args": [rec], "output": [out]}}, task="tensor")
    return root


HUGE = int("9" * 400)
BAD_DUMPS = {
    "entry_int": lambda r: _with_entry(r, 7),
    "entry_str": lambda r: _with_entry(r, "x"),
    "entry_list": lambda r: _with_entry(r, [1, 2]),
    "shape_int": lambda r: _with_entry(r, {"input_args": [{**stat_record(1, 0, 0, 1), "shape": 7}],
                                           "output": [stat_record(1, 0, 0, 1)]}),
    "max_400_digits": lambda r: _with_entry(r, _entry(max_=HUGE)),
    "shape_400_digits": lambda r: _with_entry(r, {"input_args": [stat_record(1, 0, 0, 1, shape=[HUGE])],
                                                  "output": [stat_record(1, 0, 0, 1)]}),
    "no_shape_no_dtype": lambda r: _with_entry(r, {"input_args": [{"type": "torch.Tensor", "Max": 1, "Min": 0,
                                                                   "Mean": 0, "Norm": 1}],
                                                   "output": [stat_record(1, 0, 0, 1)]}),
    "zero_byte_json": lambda r: _raw_dump(r, b""),
    "not_utf8_json": lambda r: _raw_dump(r, b'{"task": "\xff\xfe"}'),
    "top_level_list": lambda r: _raw_dump(r, "[1, 2]"),
    "truncated_json": lambda r: _raw_dump(r, '{"task": "statistics", "data": {'),
    "empty_dir": lambda r: (r.mkdir(), r)[1],
    "zero_byte_pt": lambda r: _tensor_dump(r, b""),
    "garbage_pt": lambda r: _tensor_dump(r, b"PK\x03\x04 not a tensor"),
}


def _argv(verb: str, bad: Path, good: Path, out: Path) -> list[str]:
    return {
        "analyze": ["analyze", str(bad)],
        "compare": ["compare", str(good), str(bad), "-o", str(out / "c.csv")],
        "graph_tp": ["graph", "-tp", str(bad), "-o", str(out / "g")],
        "graph_gp": ["graph", "-tp", str(good), "-gp", str(bad), "-o", str(out / "g")],
        "run_ut": ["run_ut", "-i", str(bad), "-o", str(out / "ut")],
        "generate_operator": ["generate_operator", "-i", str(bad), "--api", API, "-o", str(out / "r.py")],
    }[verb]


DUMP_VERBS = ["analyze", "compare", "graph_tp", "graph_gp", "run_ut", "generate_operator"]


def _one_error_line(capsys, verb: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("msprobe-engine")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert ": error: " in lines[0]
    return lines[0]


# Inputs a tolerant verb may read around (the entry named, listed as a problem, the rest used);
# everything else must stop the verb with exit 1.
TOLERATED = {(v, k) for v in ("compare", "analyze", "graph_tp", "graph_gp") for k in ("no_shape_no_dtype", "entry_int", "entry_str", "entry_list", "shape_int", "max_400_digits",
                                      "shape_400_digits")} | \
            {(v, k) for v in ("analyze", "graph_tp", "graph_gp") for k in ("zero_byte_pt", "garbage_pt")} | \
            {("compare", "zero_byte_pt"), ("compare", "garbage_pt"), ("generate_operator", "garbage_pt"),
             ("generate_operator", "zero_byte_pt")}


@pytest.mark.parametrize("verb", DUMP_VERBS)
@pytest.mark.parametrize("kind", sorted(BAD_DUMPS))
def test_corrupt_dump_ends_in_one_line_naming_the_file(tmp_path, capsys, verb, kind):
    good = _good(tmp_path / "good")
    bad = BAD_DUMPS[kind](tmp_path / "bad")
    (tmp_path / "out").mkdir()
    code = main(_argv(verb, bad, good, tmp_path / "out"))
    if (verb, kind) in TOLERATED and code == 0:
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        if not kind.endswith("_pt"):  # statistics verbs do not open tensor files
            assert API in out.out + out.err  # the dropped entry is named
        return
    assert code == 1, capsys.readouterr()
    line = _one_error_line(capsys, verb)
    assert "bad" in line  # the path of the bad input is named


def test_run_ut_stops_on_a_bad_tensor_file_as_documented(tmp_path, capsys):
    bad = _tensor_dump(tmp_path / "bad", b"")
    assert main(["run_ut", "-i", str(bad), "-o", str(tmp_path / "out")]) == 1
    line = _one_error_line(capsys, "run_ut")
    assert f"{API}.input.0.pt" in line and "cannot load tensor" in line


def test_debug_shows_the_traceback(tmp_path):
    bad = BAD_DUMPS["zero_byte_json"](tmp_path / "bad")
    with pytest.raises(Exception):
        main(["analyze", str(bad), "--debug"])


def test_non_utf8_directory_name_is_printed_escaped(tmp_path, capsys):
    root = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/d\xffump"))
    _raw_dump(root, "{")
    assert main(["analyze", str(root)]) == 1
    line = _one_error_line(capsys, "analyze")
    assert "d\\udcffump" in line or "d\\xffump" in line
    good = _good(tmp_path / "good")
    assert main(["graph", "-tp", str(good), "-o", str(root / "g")]) == 0
    assert capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["compare", "a", "b", "--rtol", "nan"], ["compare", "a", "b", "--rtol", "inf"], ["compare", "a", "b", "--rtol", "-1"],
    ["compare", "a", "b", "--atol", "nan"], ["compare", "a", "b", "--threshold", "cosine_error=nan"],
    ["compare", "a", "b", "--threshold", "stat_rel_error=-inf"], ["analyze", "d", "--mutation-ratio", "nan"],
    ["analyze", "d", "--mutation-ratio", "-5"], ["analyze", "d", "--mutation-ratio", "0"],
    ["tensorboard", "--logdir", "x", "--port", "9" * 400], ["run_ut", "--online", "--queue-size", "0"],
])
def test_bad_numeric_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def _run(root: Path, lines: list[bytes]) -> Path:
    rank = root / "rank0"
    rank.mkdir(parents=True)
    (rank / "metrics.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    return root


def _record(step: int, value: object = 1.0) -> bytes:
    return json.dumps({"step": step, "metrics": {"train/loss": value}}).encode()


def test_compare_runs_skips_a_non_utf8_line_and_a_huge_number(tmp_path, capsys):
    a = _run(tmp_path / "a", [_record(0), _record(1), _record(2)])
    b = _run(tmp_path / "b", [_record(0), b'{"step": 1, "metrics": {"train/loss": 1.0, "x\xff": 2}}',
                              _record(2, HUGE), _record(3)])
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "metrics.jsonl:2" in out and "metrics.jsonl:3" in out  # both skipped lines listed by file:line


def test_compare_runs_with_nothing_in_common_is_not_an_all_clear(tmp_path, capsys):
    a = _run(tmp_path / "a", [_record(0)])
    b = _run(tmp_path / "b", [b"\xff\xfe garbage"])
    assert main(["compare", str(a), str(b)]) == 1
    assert "nothing compared" in _one_error_line(capsys, "compare")


def _monitor_run(root: Path) -> Path:
    return _run(root, [_record(0)])


@pytest.mark.parametrize("make", [
    lambda r: (r.mkdir(), r)[1],
    _monitor_run,
    _good,
    lambda r: (r.parent.mkdir(exist_ok=True), _good(r.parent / "real"), r.symlink_to(r.parent / "real"), r)[-1],
], ids=["empty", "monitor_run", "statistics_dump", "symlinked_dump"])
def test_free_benchmark_on_nothing_to_check_fails(tmp_path, capsys, make):
    target = make(tmp_path / "target")
    assert main(["free-benchmark", str(target)]) == 1
    line = _one_error_line(capsys, "free-benchmark")
    assert "nothing checked" in line and "every compared API passed" not in line


@pytest.mark.parametrize("content", [b"", b"\xff\xfe\x00", b"a: [", b"- 1\n- 2\n"])
def test_check_config_on_a_broken_file(tmp_path, capsys, content):
    cfg = tmp_path / "bad.yaml"
    cfg.write_bytes(content)
    assert main(["check-config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "bad.yaml" in err


def test_grad_probe_on_an_empty_directory(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    assert main(["grad-probe", str(tmp_path / "a"), "-o", str(tmp_path / "o")]) == 1
    _one_error_line(capsys, "grad-probe")


def test_graph_incident_with_a_string_culprit(tmp_path, capsys):
    incident = tmp_path / "inc"
    _good(incident / "dump")
    (incident / "incident.json").write_text(json.dumps({"culprit": "layers.0"}))
    assert main(["graph", str(incident)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert (incident / "graph").is_dir()


def test_graph_into_an_existing_shared_directory_keeps_it_as_it_was(tmp_path, capsys):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "someone_elses.html").write_text("theirs")
    good = _good(tmp_path / "good")
    assert main(["graph", "-tp", str(good), "-o", str(shared)]) == 0
    assert os.stat(shared).st_mode & 0o7777 == 0o1777
    assert (shared / "someone_elses.html").read_text() == "theirs"
    subs = [d for d in shared.iterdir() if d.is_dir()]
    assert len(subs) == 1 and subs[0].name.startswith("graph_") and any(subs[0].glob("*.vis.db"))
    assert not list(shared.rglob("*.partial"))


def test_graph_on_an_unwritable_database_leaves_nothing_behind(tmp_path, capsys):
    good = _good(tmp_path / "good")
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "x")  # not empty: a graph_<time> subdirectory is made; then it is made read-only
    os.chmod(out, 0o555)
    try:
        code = main(["graph", "-tp", str(good), "-o", str(out)])
    finally:
        os.chmod(out, 0o755)
    if os.geteuid() != 0:  # root writes anyway
        assert code == 1
        _one_error_line(capsys, "graph")
    assert not list(out.rglob("*.partial"))
