"""Every CLI verb that reads files, against each corruption of what it reads (truncated, a wrong
type, a non-UTF-8 byte, a missing key): the verb either stops with one line naming the exact
file and the entry in it (line, key or step), exit 1, or, where it reads around a bad entry,
lists that file and entry and goes on. Never a traceback. Inputs are small hand-written files.

(`tensorboard` reads nothing itself: TensorBoard reads the event files; its missing logdir is in
test_cli_probes.py.)"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from dumpgen import stat_record, write_dump_json
from msprobe_engine.cli import main

API = "Functional.relu.0.forward"
NOT_UTF8 = b"\xff\xfe"


def _dump(root: Path, entry: object = None) -> Path:
    good = {"input_args": [stat_record(1.0, -1.0, 0.0, 2.0)], "output": [stat_record(1.0, 0.0, 0.5, 1.5)]}
    write_dump_json(root / "step0" / "rank0", {API: good if entry is None else entry,
                                               "Functional.gelu.0.forward": good})
    return root


def _bytes_at(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


# ---- one valid input per reader, and where its corruptions go -------------------------------
def _metrics_jsonl(root: Path, bad_line: bytes) -> None:
    lines = [json.dumps({"step": s, "metrics": {"train/loss": 1.0}}).encode() for s in range(3)]
    lines.insert(2, bad_line)
    _bytes_at(root / "rank0" / "metrics.jsonl", b"\n".join(lines) + b"\n")


def _free_benchmark_csv(root: Path, bad_row: bytes) -> None:
    head = b"rank,pert_mode,stage,step,api_name,max_rel,dtype,shape,output_index\n"
    row = b"0,improve_precision,forward,0,Torch.var.0.forward,0.5,torch.float32,[2],0\n"
    _bytes_at(root / "step0" / "rank0" / "free_benchmark.csv", head + row + bad_row + b"\n" + row)


def _grad_probe_run(root: Path, summary_row: bytes = b"", npy: bytes | None = None) -> None:
    rank = root / "rank0"
    for step in (0, 1):
        head = b"param_name,max,min,norm,shape\n"
        body = b"fc.weight,1,0,1,[2]\n" + (summary_row + b"\n" if step == 0 and summary_row else b"")
        _bytes_at(rank / f"grad_summary_{step}.csv", head + body)
        (rank / f"step{step}").mkdir(parents=True, exist_ok=True)
        np.save(rank / f"step{step}" / "fc.weight.npy", np.array([True, False]))
    if npy is not None:
        _bytes_at(rank / "step1" / "fc.weight.npy", npy)


def _environment(root: Path, content: bytes) -> None:
    _bytes_at(root / "rank0" / "environment.json", content)


def _npy_of(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


Case = tuple[Callable[[Path], list[str]], str, str]  # (make the input -> argv, file named, entry named)


def _runs(bad_line: bytes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        _metrics_jsonl(tmp / "a", json.dumps({"step": 1, "metrics": {"train/loss": 1.0}}).encode())
        _metrics_jsonl(tmp / "b", bad_line)
        return ["compare", str(tmp / "a"), str(tmp / "b")]
    return make


def _free_benchmark(bad_row: bytes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        _free_benchmark_csv(tmp / "fb", bad_row)
        return ["free-benchmark", str(tmp / "fb")]
    return make


def _grad_probe(summary_row: bytes = b"", npy: bytes | None = None) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        _grad_probe_run(tmp / "gp", summary_row, npy)
        return ["grad-probe", str(tmp / "gp"), "-o", str(tmp / "out")]
    return make


def _config_check(content: bytes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        _environment(tmp / "a", b'{"python": "3.11"}')
        _environment(tmp / "b", content)
        return ["config-check", str(tmp / "a"), str(tmp / "b")]
    return make


def _check_config(content: bytes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        return ["check-config", str(_bytes_at(tmp / "bad.yaml", content))]
    return make


def _incident(content: bytes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        _dump(tmp / "inc" / "dump")
        _bytes_at(tmp / "inc" / "incident.json", content)
        return ["graph", str(tmp / "inc")]
    return make


def _dump_verb(verb: str, content: bytes | None = None, entry: object = None) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        good, bad = _dump(tmp / "good"), tmp / "bad"
        if content is None:
            _dump(bad, entry)
        else:
            _bytes_at(bad / "step0" / "rank0" / "dump.json", content)
        return {"analyze": ["analyze", str(bad)],
                "compare": ["compare", str(good), str(bad)],
                "find-divergence": ["compare", str(good), str(bad), "--find-divergence"],
                "graph": ["graph", "-tp", str(good), "-gp", str(bad), "-o", str(tmp / "g")],
                "run_ut": ["run_ut", "-i", str(bad), "-o", str(tmp / "ut")],
                "generate_operator": ["generate_operator", "-i", str(bad), "--api", API, "-o", str(tmp / "r.py")],
                }[verb]
    return make


def _ignore_rules(content: bytes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        return ["analyze", str(_dump(tmp / "good")), "--rules", str(_bytes_at(tmp / "rules.yaml", content))]
    return make


def _run_ut_resume(content: bytes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        _bytes_at(tmp / "ut" / "accuracy_checking_result_1.csv", content)
        return ["run_ut", "-i", str(_dump(tmp / "good")), "-o", str(tmp / "ut"), "--resume"]
    return make


DUMP_JSON = "bad/step0/rank0/dump.json"
CASES: dict[str, Case] = {
    # compare A B on two monitor runs: metrics.jsonl, by line
    "runs-truncated": (_runs(b'{"step": 7, "metr'), "b/rank0/metrics.jsonl", ":3"),
    "runs-wrong-type": (_runs(b'{"step": "7", "metrics": []}'), "b/rank0/metrics.jsonl", ":3"),
    "runs-not-utf8": (_runs(b'{"step": 7, "metrics": {"\xff": 1}}'), "b/rank0/metrics.jsonl", ":3"),
    "runs-missing-key": (_runs(b'{"step": 7}'), "b/rank0/metrics.jsonl", ":3"),
    # free-benchmark: free_benchmark.csv, by line
    "free-benchmark-truncated": (_free_benchmark(b"0,improve_precision,forw"), "step0/rank0/free_benchmark.csv",
                                 "line 3"),
    "free-benchmark-wrong-type": (_free_benchmark(b"0,improve_precision,forward,0,Torch.x.0.forward,abc,f,[2],0"),
                                  "step0/rank0/free_benchmark.csv", "line 3"),
    "free-benchmark-not-utf8": (_free_benchmark(b"0,improve_precision,forward,0,Torch.\xff.0.forward,1,f,[2],0"),
                                "step0/rank0/free_benchmark.csv", "line 3"),
    "free-benchmark-missing-key": (lambda tmp: (_bytes_at(tmp / "fb" / "step0" / "rank0" / "free_benchmark.csv",
                                                          b"rank,step,api_name\n0,0,Torch.var.0.forward\n"),
                                                ["free-benchmark", str(tmp / "fb")])[1],
                                   "step0/rank0/free_benchmark.csv", "max_rel"),
    # grad-probe: grad_summary_<step>.csv by line, <param>.npy by file
    "grad-probe-truncated": (_grad_probe(npy=_npy_of(np.array([True, False]))[:60]), "rank0/step1/fc.weight.npy",
                             "fc.weight"),
    "grad-probe-wrong-type": (_grad_probe(npy=_npy_of(np.array([1.0, 2.0]))), "rank0/step1/fc.weight.npy", "float64"),
    "grad-probe-not-utf8": (_grad_probe(summary_row=b"fc.\xff,1,0,1,[2]"), "rank0/grad_summary_0.csv", "line 3"),
    "grad-probe-missing-key": (_grad_probe(summary_row=b"fc.bias,1,0,1,[2]"), "rank0/step0/fc.bias.npy", "fc.bias"),
    # config-check: environment.json
    "config-check-truncated": (_config_check(b'{"python": '), "b/rank0/environment.json", "line 1"),
    "config-check-wrong-type": (_config_check(b"[1, 2]"), "b/rank0/environment.json", "list"),
    "config-check-not-utf8": (_config_check(b'{"python": "\xff"}'), "b/rank0/environment.json", "line 1"),
    # check-config: the YAML file, by line or key
    "check-config-truncated": (_check_config(b"alerts:\n  - rule: spike\n    factor: ["), "bad.yaml", "line 3"),
    "check-config-wrong-type": (_check_config(b"alerts:\n  - rule: spike\n    factor: abc\n"), "bad.yaml",
                                "alerts[0].factor"),
    "check-config-not-utf8": (_check_config(b"run_name: ok\nsinks: [\xff]\n"), "bad.yaml", "line 2"),
    "check-config-missing-key": (_check_config(b"alerts:\n  - factor: 2.0\n"), "bad.yaml", "alerts[0]"),
    # analyze --rules: the ignore-rule file, by line or rule
    "analyze-rules-truncated": (_ignore_rules(b"ignore:\n  - api: ["), "rules.yaml", "line 2"),
    "analyze-rules-wrong-type": (_ignore_rules(b"ignore: 7\n"), "rules.yaml", "ignore"),
    "analyze-rules-not-utf8": (_ignore_rules(b"ignore:\n  - api: Torch.\xff\n"), "rules.yaml", "line 2"),
    "analyze-rules-missing-key": (_ignore_rules(b"ignore:\n  - inputs: [0]\n"), "rules.yaml", "ignore[0]"),
    # run_ut --resume: the earlier result file
    "run_ut-resume-not-utf8": (_run_ut_resume(b"name,result\nTorch.\xff,pass\n"),
                               "ut/accuracy_checking_result_1.csv", "line 2"),
    # graph <incident>: incident.json
    "graph-incident-truncated": (_incident(b'{"culprit": '), "inc/incident.json", "line 1"),
    "graph-incident-wrong-type": (_incident(b'"x"'), "inc/incident.json", "object"),
    "graph-incident-not-utf8": (_incident(b'{"culprit": "\xff"}'), "inc/incident.json", "line 1"),
    # the dump readers: dump.json by line, by entry
    **{f"{verb}-truncated": (_dump_verb(verb, b'{"task": "statistics", "data": {'), DUMP_JSON, "line 1")
       for verb in ("analyze", "compare", "find-divergence", "graph", "run_ut", "generate_operator")},
    **{f"{verb}-not-utf8": (_dump_verb(verb, b'{"task": "statistics",\n "level": "\xff"}'), DUMP_JSON, "line 2")
       for verb in ("analyze", "compare", "find-divergence", "graph", "run_ut", "generate_operator")},
    **{f"{verb}-wrong-type": (_dump_verb(verb, entry=7), DUMP_JSON, API)
       for verb in ("analyze", "compare", "find-divergence", "graph", "run_ut", "generate_operator")},
    **{f"{verb}-missing-key": (_dump_verb(verb, entry={"input_args": [{"type": "torch.Tensor", "Max": 1}],
                                                       "output": []}), DUMP_JSON, API)
       for verb in ("analyze", "compare", "find-divergence", "graph", "run_ut", "generate_operator")},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_reader_names_the_file_and_the_entry(tmp_path, capsys, case):
    make, file, entry = CASES[case]
    code = main(make(tmp_path))
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    text = (out.out + out.err).replace(str(tmp_path) + "/", "")
    named = [line for line in text.splitlines() if file in line and entry in line]
    assert named, f"exit {code}; no line names {file!r} and {entry!r}:\n{text}"
    if code != 0:
        assert code == 1, text
        errors = [line for line in out.err.splitlines() if line.startswith("msprobe-engine") or "error" in line]
        assert errors, text
