"""The `predecessor_csv` sink: the predecessor's per-metric CSV files, read by its own CSV tool.

A monitored run writes them; the predecessor's ``csv2tensorboard_by_step`` (in a child
process: it starts processes of its own) turns them into TensorBoard files, and every scalar
there equals the value our run recorded for the same tag (read back from our JSONL sink).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from msprobe_engine import Monitor
from msprobe_engine.sinks.predecessor_csv import _place

WATCH = {"module_outputs": True, "activation_grads": True, "param_grads": True, "params": True,
         "optimizer_state": ["exp_avg", "exp_avg_sq"]}
STATS = ["min", "max", "mean", "norm", "nan_count", "zero_frac"]


def _run(out: Path, steps: int = 3, **sink) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    mon = Monitor({"output_dir": str(out), "run_name": "run", "strict": True, "stats": STATS, "watch": WATCH,
                   "sinks": [{"name": "predecessor_csv", **sink}, "jsonl"]}).attach(model, opt)
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        mon.step_end()
    mon.close()
    return out / "run"


def test_tags_map_onto_its_files_and_names():
    assert _place("actv/layers.0.mlp/output/norm") == ("actv", "layers.0.mlp.output", "norm")
    assert _place("actv/layers.0/input.1/nan_count") == ("actv", "layers.0.input_1", "nans")
    assert _place("actv_grad/fc/output/zero_frac") == ("actv_grad", "fc.output_grad", "zeros")
    assert _place("grad/fc.weight/max") == ("grad_reduced", "fc.weight", "max")
    assert _place("optim/fc.weight/exp_avg_sq/min") == ("exp_avg_sq", "fc.weight", "min")
    assert _place("param/fc.weight/mean") == ("param_updated", "fc.weight", "mean")
    assert _place("grad/global/norm") is None and _place("train/loss") is None
    assert _place("optim/fc.weight/ratio") is None


def test_steps_per_file_groups_steps(tmp_path):
    run = _run(tmp_path, steps=3, steps_per_file=2)
    (directory,) = run.glob("*-rank0-msprobe_engine")
    assert sorted(p.name for p in directory.glob("grad_reduced_*")) == ["grad_reduced_0-1.csv", "grad_reduced_2-3.csv"]
    lines = (directory / "grad_reduced_0-1.csv").read_text().splitlines()
    assert lines[0] == "vpp_stage,name,step,min,max,mean,norm,nans,zeros" and len(lines) == 1 + 2 * 4


_CSV2TB = """
import sys
from msprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step
csv2tensorboard_by_step(sys.argv[1], output_dirpath=sys.argv[2])
"""


@pytest.mark.slow
def test_its_csv2tensorboard_reads_our_files_value_for_value(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run(tmp_path / "out")
    out = tmp_path / "tb"
    done = subprocess.run([sys.executable, "-c", _CSV2TB, str(run), str(out)], capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    ours: dict[tuple[str, str], dict[int, float]] = {}
    for line in (run / "rank0" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for tag, value in record["metrics"].items():
            placed = _place(tag)
            if placed is not None:
                kind, name, op = placed
                ours.setdefault((kind, f"{name}/{op}"), {})[record["step"]] = value
    compared = 0
    for kind in ("actv", "actv_grad", "grad_reduced", "param_updated", "exp_avg", "exp_avg_sq"):
        events = EventAccumulator(str(out / "rank0" / kind))
        events.Reload()
        tags = events.Tags()["scalars"]
        assert tags, f"its tool wrote no scalars for {kind}"
        for tag in tags:
            where, _, op = tag.rpartition("/")  # vp<stage>:<name>[:micro<k>]/<op>
            vpp, _, name = where.partition(":")
            name = name.split(":micro")[0]
            assert vpp == "vp0"
            name = f"{name}/{op}"
            series = {e.step: e.value for e in events.Scalars(tag)}
            expected = ours[(kind, name)]
            assert set(series) == set(expected) == {0, 1, 2}, tag
            for step, value in series.items():
                assert value == pytest.approx(expected[step], rel=1e-6, abs=1e-12), (tag, step)
                compared += 1
    assert compared > 100
