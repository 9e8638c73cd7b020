"""A partial column from outside the package (tests/plugins/absmax_column.py): one registration
and one reducer per backend, and a statistic using it, from the config alone. Run in a child
process: a registered column widens every row of the process that registers it."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
import numpy as np
import torch
from torch import nn
from msprobe_engine.frameworks.torch import backend
from msprobe_integrations.torch import TorchMonitor

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
monitor = TorchMonitor(model, opt, config={
    "plugins": ["tests.plugins.absmax_column"], "output_dir": sys.argv[1], "strict": True,
    "stats": ["norm", "max", "min", "absmax"], "sinks": ["jsonl"]})
from msprobe_engine.stats import columns, reference_partial
for step in range(2):
    for micro in range(2):  # two micro-steps: the column merges by max
        model(torch.randn(2, 3) * (1 + 3 * micro)).mean().backward()
    opt.step(); opt.zero_grad()
    monitor.step_end(torch.tensor(1.0))
monitor.close()
last = monitor.history[-1].metrics
tensors = [torch.tensor([-7.0, 2.0, 0.0]), torch.randn(5000), torch.randn(70000), torch.zeros(0)]
rows = backend.partial_stats(tensors).numpy()
print(json.dumps({
    "names": list(columns.names()),
    "metrics": {k: v for k, v in last.items() if k.startswith(("actv/0/output/", "grad/0.weight/"))},
    "rows": rows[:, columns.index("absmax")].tolist(),
    "expected": [float(t.abs().max()) if t.numel() else 0.0 for t in tensors],
    "reference": reference_partial(np.array([-7.0, 2.0, 0.0]))[columns.index("absmax")],
    "builtin_same": bool(np.array_equal(rows[:, :8], backend.partial_stats(tensors).numpy()[:, :8], equal_nan=True)),
}))
"""


def test_a_column_and_its_statistic_from_a_plugin(tmp_path):
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["names"][-1] == "absmax" and out["names"][:2] == ["min", "max"]
    assert out["rows"] == pytest.approx(out["expected"]) and out["reference"] == 7.0
    metrics = out["metrics"]
    for prefix in ("actv/0/output/", "grad/0.weight/"):
        assert metrics[f"{prefix}absmax"] == pytest.approx(max(abs(metrics[f"{prefix}max"]),
                                                               abs(metrics[f"{prefix}min"])))
    assert out["builtin_same"]


MINDSPORE_CHILD = r"""
import json
import numpy as np
import mindspore as ms
from mindspore import Tensor, ops
from msprobe_engine.frameworks.mindspore import backend
from msprobe_engine.stats import PartialColumn, columns, register_column

register_column(PartialColumn("absmax", 0.0, "max"), mindspore=lambda flat: ops.abs(flat).max())
register_column(PartialColumn("no_reducer", 0.0, "sum"))
arrays = [np.array([-7.0, 2.0, 0.0], np.float32), np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros(0, np.float32)]
rows = backend.to_host(backend.partial_stats([Tensor(a) for a in arrays]))
print(json.dumps({"shape": list(rows.shape), "absmax": rows[:, columns.index("absmax")].tolist(),
                  "no_reducer": rows[:, columns.index("no_reducer")].tolist()}))
"""


def test_a_registered_column_on_the_mindspore_backend(tmp_path):
    """Its `mindspore` reducer measures it after the compiled graph's built-in columns; a column
    without a reducer there is nan (an empty tensor: the identity)."""
    child = subprocess.run([sys.executable, "-c", MINDSPORE_CHILD], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["shape"] == [3, 10]
    assert out["absmax"] == [7.0, 5.0, 0.0]
    assert all(math.isnan(v) for v in out["no_reducer"][:2])
    assert out["no_reducer"][2] == 0.0
