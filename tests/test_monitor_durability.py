"""Durability of the monitor's records: a run that ends without `Monitor.close()` (a normal
end, an exception, SIGTERM, SIGINT) keeps the record of every step it ended, in every sink
(metrics.jsonl, metrics.csv, the TensorBoard events), and its saved state; a signal still ends
the process by that signal. The child (`monitor_exit_run.py`) has a sink that sleeps 50 ms per
record, so its writer is behind when the loop ends: before the exit guard, 20 steps left 6
lines in metrics.jsonl."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from exit_helpers import signal_mid_run
from health_models import build, train
from msprobe_engine.monitor import Monitor
from msprobe_engine.sinks.base import Sink, register_sink

TESTS = Path(__file__).parent
RUN = [sys.executable, str(TESTS / "monitor_exit_run.py")]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
#: a rule whose action needs the decision before the optimizer step: each step's record waits
#: for the next step's transfer (the last one for close(), or the exit guard)
EARLY = {"alerts": [{"rule": "non_finite", "action": "skip"}]}


def _args(out: Path, steps: int, usage: str, **config) -> list[str]:
    return [*RUN, str(out), str(steps), usage, json.dumps(config)]


def _steps_in_every_sink(out: Path) -> list[int]:
    """The steps recorded, the same in metrics.jsonl, metrics.csv and the TensorBoard events."""
    rank = out / "run" / "rank0"
    lines = (rank / "metrics.jsonl").read_text().splitlines()
    jsonl = [json.loads(line)["step"] for line in lines]
    with open(rank / "metrics.csv", newline="") as file:
        in_csv = sorted({int(row["step"]) for row in csv.DictReader(file)})
    events = EventAccumulator(str(rank), size_guidance={"scalars": 0}).Reload()
    # a step the signal interrupted may be recorded without its loss (it never reached step_end):
    # the steps with any scalar, not those with Health/loss
    in_tb = sorted({event.step for tag in events.Tags()["scalars"] for event in events.Scalars(tag)})
    assert jsonl == in_csv == in_tb, (jsonl, in_csv, in_tb)
    return jsonl


def _counters(child_stdout: str) -> dict:
    return json.loads(child_stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("config", [{}, EARLY], ids=["default", "decided_early"])
def test_every_step_is_recorded_at_exit_without_close(tmp_path, config):
    child = subprocess.run(_args(tmp_path, 20, "steps", **config), capture_output=True, text=True, env=ENV,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert _steps_in_every_sink(tmp_path) == list(range(20))
    assert _counters(child.stdout) == {"records_written": 20, "dropped": 0, "failures": {}}
    assert json.loads((tmp_path / "run" / "rank0" / "monitor_state.json").read_text())["step"] == 20


@pytest.mark.slow
def test_an_exception_leaving_the_loop_keeps_every_ended_step(tmp_path):
    child = subprocess.run(_args(tmp_path, 12, "raise"), capture_output=True, text=True, env=ENV, timeout=300)
    assert child.returncode == 1 and "the training loop failed" in child.stderr
    assert _steps_in_every_sink(tmp_path) == list(range(11))  # step 11 never reached step_end


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_run_keeps_every_ended_step_and_still_ends_the_process(tmp_path, signum):
    ended, _ = signal_mid_run(_args(tmp_path, 0, "forever", **EARLY), ENV, signum, after=8)  # the writer behind
    steps = _steps_in_every_sink(tmp_path)
    assert steps[:ended] == list(range(ended)) and len(steps) <= ended + 1


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_inside_a_step_end_ends_the_process_after_that_steps_record(tmp_path, signum):
    """The signal lands while step 5's record is being made (a rule sends it from its
    evaluation): its exception is raised when `step_end` returns, so the record is queued
    and written at exit, and the process still ends by the signal."""
    config = {"alerts": [{"rule": "signal_at", "step": 5, "signum": int(signum)}]}
    child = subprocess.run(_args(tmp_path, 0, "forever", **config), capture_output=True, text=True, env=ENV,
                           timeout=300)
    assert child.returncode == -signum, child.stderr[-2000:]
    ended = [word for word in child.stdout.split() if word.isdigit()]
    assert ended == ["1", "2", "3", "4", "5"]  # step 5's step_end raised as it returned
    assert _steps_in_every_sink(tmp_path) == list(range(6))


@register_sink("slow_in_test")
class _SlowSink(Sink):
    def write(self, record) -> None:
        time.sleep(0.05)


def test_close_writes_the_state_even_when_the_queue_drops_records(tmp_path):
    """A full queue with `when_full: drop` drops records, never the jobs that close the files."""
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = Monitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["slow_in_test", "jsonl"],
                       "writer": {"queue_size": 2, "when_full": "drop"}, "incidents": {"enabled": False},
                       "control": {"enabled": False}}).attach(model, optimizer)
    train(model, monitor, 8, optimizer)
    monitor.close()
    monitor.close()  # a second close does nothing
    assert monitor.writer.dropped > 0
    assert json.loads((tmp_path / "run" / "rank0" / "monitor_state.json").read_text())["step"] == 8
