"""Durability: the predecessor's usage (no close()) keeps every step that step() closed, at a
normal end, an exception, SIGTERM and SIGINT; a step is committed only when all its files were
written whole (file-size limit, full disk), else dropped, counted and removed."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dump_helpers import train_tiny_gpt
from exit_helpers import signal_mid_run
from msprobe_engine.dump import PrecisionDebugger, iter_dump_tensors, load_dump

TESTS = Path(__file__).parent
RUN = [sys.executable, str(TESTS / "dump_exit_run.py")]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}


def _args(dump: Path, task: str, steps: int, usage: str, limit: int = 0, width: int = 512, **config) -> list[str]:
    return [*RUN, str(dump), task, str(steps), usage, str(limit), json.dumps(config), str(width)]


def _run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(_args(*args, **kwargs), capture_output=True, text=True, env=ENV, timeout=300)


def _counters(child: subprocess.CompletedProcess) -> dict:
    """The child's JSON line, printed at exit after the session was closed there."""
    return json.loads(child.stdout.strip().splitlines()[-1])


def _complete_steps(dump: Path) -> list[int]:
    """The steps on disk, each checked whole: dump.json valid, every tensor file it lists present."""
    dumps = load_dump(dump)  # strict: every dump.json present is complete and valid
    for rank_dump in dumps.values():
        for ref in iter_dump_tensors({"data": rank_dump.data}):
            if "data_name" in ref.record:
                assert rank_dump.tensor_file(ref).stat().st_size > 0
    assert not list(dump.glob("step*/.*.partial"))
    return sorted(step for step, _ in dumps)


@pytest.mark.parametrize("task,usage,config", [
    ("statistics", "steps", {}),
    ("statistics", "steps", {"step": [0, 1]}),
    ("tensor", "steps", {}),        # was: exit 134 with the writer thread in torch.save
    ("statistics", "scope", {}),
])
def test_every_closed_step_is_on_disk_at_exit_without_close(tmp_path, task, usage, config):
    child = _run(tmp_path / "dump", task, 3, usage, **config)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "terminate called" not in child.stderr
    wanted = config.get("step", [0, 1, 2])
    assert _complete_steps(tmp_path / "dump") == wanted
    assert _counters(child) == {"steps_written": len(wanted), "dropped_steps": 0, "drop_reasons": {}}


def test_an_exception_leaving_the_loop_keeps_the_steps_and_the_open_one(tmp_path):
    child = _run(tmp_path / "dump", "tensor", 3, "raise")
    assert child.returncode == 1 and "the training loop failed" in child.stderr
    assert _complete_steps(tmp_path / "dump") == [0, 1, 2]  # step 2 was open: close() at exit commits it


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_run_keeps_every_closed_step_and_still_ends_the_process(tmp_path, signum):
    dump = tmp_path / "dump"
    closed, _ = signal_mid_run(_args(dump, "tensor", 0, "forever", width=128), ENV, signum, after=3)
    steps = _complete_steps(dump)
    assert steps[:closed] == list(range(closed)) and len(steps) <= closed + 1


def test_close_is_idempotent(tmp_path):
    debugger = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1"})
    train_tiny_gpt(2, debugger)
    debugger.close()
    debugger.close()
    assert debugger.steps_written == 2 and sorted(load_dump(tmp_path)) == [(0, None), (1, None)]


def test_a_file_size_limit_drops_the_steps_that_do_not_fit(tmp_path):
    """200 KB per file: each step's first tensor files fit, a later one does not."""
    child = _run(tmp_path / "dump", "tensor", 3, "steps", limit=200_000)
    assert child.returncode == 0, child.stderr[-2000:]
    assert _counters(child) == {"steps_written": 0, "dropped_steps": 3,
                                "drop_reasons": {"a file could not be written whole": 3}}
    assert child.stderr.count("step 0 dropped") == 1 and "further drops are counted" in child.stderr
    assert not list((tmp_path / "dump").iterdir())  # no step directory, no .partial left


def test_a_file_size_limit_above_every_file_commits_every_step(tmp_path):
    child = _run(tmp_path / "dump", "tensor", 3, "steps", limit=1_000_000, width=64)
    assert child.returncode == 0, child.stderr[-2000:]
    assert _counters(child)["steps_written"] == 3 and _complete_steps(tmp_path / "dump") == [0, 1, 2]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare for a private tmpfs")
def test_a_full_disk_drops_whole_steps_and_leaves_no_partial_directories(tmp_path):
    """A 5 MB tmpfs (a user and mount namespace of its own): the first steps (1.8 MB each) fit,
    then the disk is full."""
    mount = tmp_path / "disk"
    mount.mkdir()
    script = (f"mount -t tmpfs -o size=5m tmpfs {mount} && "
              + " ".join(f"'{arg}'" for arg in _args(mount / "dump", "tensor", 6, "steps", width=64))
              + f" && ls -a {mount}/dump/*/ && df -k {mount}")
    child = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=ENV,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    counters = json.loads(next(line for line in child.stdout.splitlines() if line.startswith("{")))
    assert counters["steps_written"] >= 1 and counters["dropped_steps"] >= 1
    assert counters["steps_written"] + counters["dropped_steps"] == 6
    assert ".partial" not in child.stdout  # the listing of every step directory on the full disk
    assert child.stdout.count("proc") == counters["steps_written"]
