"""Output problems: an unusable output_dir is a ConfigError before training; a full disk is
counted per sink (records, summary) with no raw traceback and no half-written JSONL line;
unfinished dump directories of an earlier crash are removed when a new dump starts."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dump_helpers import tiny_gpt_dump
from msprobe_engine.dump import find_rank_dirs
from msprobe_engine.config import ConfigError
from msprobe_engine.monitor import Monitor
from msprobe_engine.records import StepRecord
from msprobe_engine.sinks.jsonl_sink import JSONL_NAME, JsonlSink
from msprobe_engine.sinks import SINKS

TESTS = Path(__file__).parent


def test_an_output_dir_that_is_a_file_is_named_before_training(tmp_path):
    blocker = tmp_path / "out"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=rf"output_dir: cannot create {blocker}/rank0: {blocker} is a file"):
        Monitor({"output_dir": str(blocker)})
    with pytest.raises(ConfigError, match=rf"{blocker} is a file, not a directory"):
        Monitor({"output_dir": str(blocker / "below")})


def test_an_output_dir_that_cannot_be_written_is_named_with_the_reason():
    where = "/proc/msprobe-engine-cannot-write-here"  # procfs: no directory can be made there, even by root
    with pytest.raises(ConfigError, match=rf"output_dir: cannot write in {where}/rank0: .+: \w+"):
        Monitor({"output_dir": where})


@pytest.mark.slow  # spawns a process
def _full_disk_run(out, limit: int) -> subprocess.CompletedProcess:
    """tests/full_disk_run.py in a child whose files cannot grow past `limit` bytes."""
    return subprocess.run([sys.executable, str(TESTS / "full_disk_run.py"), str(out), str(limit)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])})


def test_a_full_disk_is_counted_per_sink_without_tracebacks_or_half_lines(tmp_path):
    out = tmp_path / "out"
    child = _full_disk_run(out, 20000)
    assert child.returncode == 0, child.stderr
    assert "Traceback" not in child.stderr, child.stderr
    result = json.loads(child.stdout.splitlines()[-1])
    assert set(result["failures"]) == {"tensorboard", "jsonl", "csv"}
    assert all(count > 0 for count in result["failures"].values())
    assert set(result["health"]) == {f"writer/{name}/failed" for name in ("tensorboard", "jsonl", "csv")}
    summary = [line for line in child.stderr.splitlines() if "not everything was written" in line]
    assert len(summary) == 1 and all(f"{name}: " in summary[0] for name in ("tensorboard", "jsonl", "csv"))
    text = (out / "rank0" / JSONL_NAME).read_bytes()
    assert text.endswith(b"\n")
    assert all(json.loads(line)["metrics"] for line in text.splitlines())  # every line is whole


def test_a_partial_jsonl_line_of_a_crash_is_removed_when_the_file_is_reopened(tmp_path, caplog):
    path = tmp_path / JSONL_NAME
    path.write_text('{"step": 0, "metrics": {}}\n{"step": 1, "metr')
    sink = JsonlSink(SINKS.get("jsonl").Config(name="jsonl"), tmp_path)
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        sink.open()
    sink.write(StepRecord(step=2, rank=0, micro_steps=1, metrics={"train/loss": 1.0}))
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 2]
    assert "partial line" in caplog.text


def test_unfinished_dump_steps_of_a_crash_are_removed_when_a_new_dump_starts(tmp_path, caplog):
    stale = tmp_path / "step7" / ".proc4194999.partial"  # a process that is gone (above Linux's pid_max)
    (stale / "dump_tensor_data").mkdir(parents=True)
    (stale / "dump_tensor_data" / "x.pt").write_bytes(b"0" * 1000)
    other_rank = tmp_path / "step7" / ".rank1.partial"  # another rank's: not ours to remove
    other_rank.mkdir()
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        tiny_gpt_dump(tmp_path, steps=1)
    assert not stale.exists() and other_rank.is_dir()
    assert (find_rank_dirs(tmp_path / "step0")[0] / "dump.json").is_file()
    assert "removed 1 unfinished step directory" in caplog.text


def test_a_full_disk_leaves_whole_csv_steps_and_whole_event_records(tmp_path):
    import csv as csv_module

    from msprobe_engine.sinks.csv_sink import CSV_NAME
    from msprobe_engine.sinks.tb_records import whole_frames_size

    out = tmp_path / "out"
    child = _full_disk_run(out, 30000)
    assert child.returncode == 0 and "Traceback" not in child.stderr, child.stderr
    failures = json.loads(child.stdout.splitlines()[-1])["failures"]
    rank = out / "rank0"
    text = (rank / CSV_NAME).read_bytes()
    assert text.endswith(b"\r\n")
    rows = list(csv_module.reader(text.decode().splitlines()))
    assert rows[0] == ["step", "tag", "value"]
    by_step: dict[str, list[str]] = {}
    for step, tag, _ in rows[1:]:
        by_step.setdefault(step, []).append(tag)
    layouts = {tuple(t for t in tags if not t.startswith("writer/")) for tags in by_step.values()}
    assert len(layouts) == 1  # every written step has all its rows: none half-written
    assert failures["csv"] > 0 and len(by_step) + failures["csv"] == 30  # written + lost = every step
    (events,) = rank.glob("events.out.tfevents.*")
    size = events.stat().st_size
    with open(events, "rb") as f:
        assert whole_frames_size(f.fileno(), size) == size  # no torn record at the end


def test_torn_csv_and_event_tails_are_cut_when_reopened(tmp_path, caplog):
    from msprobe_engine.sinks.record_file import RecordFile
    from msprobe_engine.sinks.tb_records import frame, whole_frames_size

    csv_path = tmp_path / "metrics.csv"
    csv_path.write_bytes(b"step,tag,value\r\n0,train/loss,1.0\r\n1,train/lo")
    events = tmp_path / "events.bin"
    events.write_bytes(frame(b"first") + frame(b"second")[:9])
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        RecordFile(csv_path).close()
        RecordFile(events, whole_frames_size).close()
    assert csv_path.read_bytes() == b"step,tag,value\r\n0,train/loss,1.0\r\n"
    assert events.read_bytes() == frame(b"first")
    assert caplog.text.count("partial line") == 2
