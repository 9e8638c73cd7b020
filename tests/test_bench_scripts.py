"""The bench scripts (docs and `make bench` print their commands) still start and run.

Nothing else runs them between benchmark sessions: `--help` of every script with options
(each imports what it uses from the engine and from each other), and two steps of
bench/step_profile.py, which wraps the monitor's own methods by name, so that a rename in the
engine is caught (every part is timed and every phase measured tensors; no figure is asserted:
this is not a timed test).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: scripts without options: libraries of the others (models, modes) and a chart report that runs at once
NO_OPTIONS = {"models.py", "modes.py", "tensorboard_charts.py"}
#: the parts it prints (docs/overhead.md reads them)
PARTS = {"forward hooks", "optimizer pre-step reads", "optimizer post-step reads", "step end: pack + transfer",
         "step end: rules", "step end: record, sinks queued", "step end: incidents", "step end: all", "add_tensors: forward",
         "add_tensors: backward (gradient hooks)", "add_tensors: pre-step", "add_tensors: post-step"}


def test_every_bench_script_starts():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    scripts = sorted(p for p in (ROOT / "bench").glob("*.py") if p.name not in NO_OPTIONS)
    assert len(scripts) >= 15
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE) for p in scripts}
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or "usage:" not in out:
            failed[name] = err[-1500:]
    assert not failed, failed


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
