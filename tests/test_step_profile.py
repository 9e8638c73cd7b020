"""bench/step_profile.py (docs/overhead.md prints it) still finds every part it times.

It wraps the monitor's own methods by name, so a rename in the engine breaks it; nothing else
runs it. Two steps of `small_lm` under full.yaml: every part is timed and every phase measured
tensors (no figure is asserted: this is not a timed test).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the parts it prints (docs/overhead.md reads them)
PARTS = {"forward hooks", "optimizer pre-step reads", "optimizer post-step reads", "step end: pack + transfer",
         "step end: rules", "step end: record, sinks queued", "step end: incidents", "step end: all", "add_tensors: forward",
         "add_tensors: backward (gradient hooks)", "add_tensors: pre-step", "add_tensors: post-step"}


def test_step_profile_times_every_part_of_a_monitored_step():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "bench/step_profile.py", "--model", "small_lm", "--config", "full",
                           "--steps", "2", "--warmup", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert PARTS <= set(figures["parts_ms"]), PARTS - set(figures["parts_ms"])
    assert {"forward", "backward (gradient hooks)", "pre-step", "post-step"} <= {
        phase for phase, count in figures["tensors"].items() if count > 0}
    assert all(ms >= 0 for ms in figures["parts_ms"].values()) and figures["ours_ms"] > 0
