"""Writing: atomic per step (a SIGKILL leaves only complete steps), bounded queue, drop counts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from dump_helpers import train_tiny_gpt
from msprobe_engine.dump import PrecisionDebugger, iter_dump_tensors, load_dump

TESTS = Path(__file__).parent

CHILD = textwrap.dedent("""
    import sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import torch
    torch.set_num_threads(1)
    from dump_helpers import SMALL, TinyGPT, synthetic_batches
    from msprobe_engine.dump import PrecisionDebugger
    debugger = PrecisionDebugger({{"task": "tensor", "dump_path": {dump!r}, "level": "mix"}})
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    for step, (tokens, targets) in enumerate(synthetic_batches(SMALL, 10_000)):
        with debugger.step_scope(model):
            model(tokens, targets).backward()
        print(step, flush=True)
""")


def test_sigkill_mid_run_leaves_every_written_step_complete(tmp_path):
    dump = tmp_path / "dump"
    script = CHILD.format(root=str(TESTS.parent), tests=str(TESTS), dump=str(dump))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while not any((dump / "step1").glob("proc*/dump.json")):  # two steps written; more in flight
            assert child.poll() is None and time.monotonic() < deadline, "the child died or hangs"
            time.sleep(0.01)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    dumps = load_dump(dump)  # strict: every dump.json present is complete and valid
    assert len(dumps) >= 2 and all(rank is None for _, rank in dumps)
    for rank_dump in dumps.values():
        refs = list(iter_dump_tensors({"data": rank_dump.data}))
        assert refs and all(rank_dump.tensor_file(ref).is_file() for ref in refs)
        assert (rank_dump.path / "construct.json").is_file()


def _gated(debugger: PrecisionDebugger) -> threading.Event:
    """Block the writer thread until the returned event is set."""
    started, gate = threading.Event(), threading.Event()
    debugger.writer.submit(lambda: (started.set(), gate.wait()), "gate")
    started.wait()
    return gate


def test_a_full_queue_drops_whole_steps_and_counts_them(tmp_path):
    """Tensor jobs that do not fit drop their step (its commit is then never queued)."""
    debugger = PrecisionDebugger({"task": "tensor", "dump_path": str(tmp_path), "level": "L0", "strict": True,
                                  "queue_size": 1, "when_full": "drop"})
    gate = _gated(debugger)
    train_tiny_gpt(3, debugger)
    gate.set()
    debugger.close()
    assert debugger.dropped_steps >= 2 and debugger.steps_written + debugger.dropped_steps == 3
    assert len(list(tmp_path.glob("step*/proc*"))) == debugger.steps_written
    assert not any(p.name.endswith(".partial") for p in tmp_path.glob("step*/.*"))


@pytest.mark.parametrize("end", ["step", "close"])
def test_a_full_queue_never_drops_the_job_that_commits_a_step(tmp_path, end):
    """`when_full: drop` with the queue full when the step ends (by `step()`, or by `close()` on a
    step still open): the commit waits for room (it was dropped, and the step with it)."""
    debugger = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "queue_size": 1, "when_full": "drop"})
    model = torch.nn.Linear(4, 2)
    debugger.start(model)
    model(torch.randn(3, 4)).sum().backward()
    debugger.stop()
    gate = _gated(debugger)
    debugger.writer.submit(lambda: None, wait=True)  # the one queue slot taken
    threading.Timer(0.3, gate.set).start()
    if end == "step":
        debugger.step()
    debugger.close()
    assert (debugger.steps_written, debugger.dropped_steps) == (1, 0)
    assert sorted(load_dump(tmp_path)) == [(0, None)]


def test_wait_policy_keeps_every_step_and_a_rerun_replaces_it(tmp_path):
    for _ in range(2):
        debugger = PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "queue_size": 1})
        gate = _gated(debugger)
        threading.Timer(0.2, gate.set).start()
        train_tiny_gpt(3, debugger)
        debugger.close()
        assert (debugger.steps_written, debugger.dropped_steps, debugger.writer.dropped) == (3, 0, 0)
    assert sorted(load_dump(tmp_path)) == [(0, None), (1, None), (2, None)]


def test_non_finite_values_are_written_as_the_reference_writes_them():
    import json

    import numpy as np

    from msprobe_engine.dump.entry import TensorSlot, render_entries
    from msprobe_engine.dump.writer import dump_json_text
    from msprobe_engine.json_text import json_special
    from msprobe_engine.stats import empty_rows

    entries = {"Functional.clip.0.forward": {"input_args": [{"type": "float", "value": float("-inf")},
                                                            {"type": "float", "value": float("nan")}],
                                             "input_kwargs": {"max": {"type": "float", "value": 0.5}},
                                             "output": [TensorSlot("torch.float32", [2], False, "none", -1)]}}
    text = dump_json_text({"task": "statistics"}, render_entries(entries, empty_rows(), special=json_special))
    assert b"-Infinity" in text and b"NaN" in text
    args = json.loads(text)["data"]["Functional.clip.0.forward"]["input_args"]
    assert args[0]["value"] == float("-inf") and np.isnan(args[1]["value"])
