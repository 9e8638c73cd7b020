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


def test_the_floor_sums_every_tensor_its_config_watches_and_merges_them_once():
    """bench/modes.py's floor (the least any tool does: the suites' and the Megatron bench's
    baseline) hooks the watched modules only, reads inputs given by keyword too, and hands the
    step's sums to its merge in one tensor."""
    import torch
    from torch import nn

    sys.path.insert(0, str(ROOT / "bench"))
    from modes import Floor

    from msprobe_engine.config import load_config

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.act, self.last = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)

        def forward(self, x):
            return self.last(input=self.act(self.first(x)))

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters())
    watch = load_config({"watch": {"module_outputs": True, "module_inputs": True, "activation_grads": True,
                                   "param_grads": True, "optimizer_state": ["exp_avg", "exp_avg_sq"]}}).watch
    merged = []
    floor = Floor(model, optimizer, watch, watched=lambda name: name in ("first", "last"), merge=merged.append)

    def step():
        optimizer.zero_grad()
        loss = model(torch.randn(3, 4)).sum()
        loss.backward()
        optimizer.step()
        return loss

    floor.run(step)
    # two modules: an input, an output and its gradient each; 4 gradients; 8 moments; the loss
    assert [len(sums) for sums in merged] == [2 * 3 + 4 + 8 + 1]
    assert floor.sums == []
