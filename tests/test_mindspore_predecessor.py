"""Our MindSpore dumps against the predecessor's (mindstudio-probe 26.2.0) MindSpore dumps, both ways.

The same net, seed and batch, one step (forward, backward, Adam) in PyNative on CPU, dumped at
L0 and L1 (statistics) and L1 (tensor) by the predecessor's `msprobe.mindspore.PrecisionDebugger` and by ours, each in a
child process (the predecessor patches MindSpore process-wide; ours runs with torch blocked).
The predecessor's MindSpore statistics call `mint.norm`, whose kernel (LinalgVectorNorm) is not
registered on MindSpore's CPU backend: its child gives the predecessor's statistics module a
`mint` whose ``norm`` is ``sqrt(sum(x * x))``, nothing else changed.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compat_helpers import CPU_NORM

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
MSPROBE = Path(sys.executable).parent / "msprobe"
LEVELS = ("L0", "L1")
#: (level, task) of every dump made on each side; "T": the L1 tensor dump
DUMPS = {"L0": ("L0", "statistics"), "L1": ("L1", "statistics"), "T": ("L1", "tensor")}

_NET = """
import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(4, 6)
        self.act = nn.Tanh()
        self.fc2 = nn.Dense(6, 2)

    def construct(self, x):
        h = mint.tanh(self.act(self.fc1(x))) * 2.0
        return self.fc2(ops.relu(h))


def one_step(debugger, pass_grads):
    ms.set_seed(0)
    net = Net()
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    x, y = (Tensor(rng.standard_normal(shape).astype(np.float32)) for shape in ((3, 4), (3, 2)))
    debugger.start(net)
    loss, grads = grad_fn(x, y)
    opt(grads)
    debugger.stop()
    debugger.step(grads) if pass_grads else debugger.step()
"""

_THEIRS = _NET + CPU_NORM + """
from msprobe.mindspore import PrecisionDebugger

one_step(PrecisionDebugger(config_path={config!r}), pass_grads=False)
"""

_OURS = """
import sys


class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")


sys.meta_path.insert(0, NoTorch())
""" + _NET + """
from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger

debugger = MindSporePrecisionDebugger(config_path={config!r})
one_step(debugger, pass_grads=True)
debugger.close()
assert "torch" not in sys.modules
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """{(side, level): the step0 directory}, every dump made at once in child processes."""
    root = tmp_path_factory.mktemp("ms_predecessor")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS.parent)}
    children, out = {}, {}
    for side, script in (("theirs", _THEIRS), ("ours", _OURS)):
        for name, (level, task) in DUMPS.items():
            path = root / f"{side}_{name}"
            config = root / f"{side}_{name}.json"
            config.write_text(json.dumps({"task": task, "dump_path": str(path), "rank": [], "step": [],
                                          "level": level, task: {"scope": [], "list": [], "data_mode": ["all"]}}))
            children[side, name] = subprocess.Popen(
                [sys.executable, "-c", script.format(config=str(config))], cwd=root, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            out[side, name] = path / "step0"
    for key, child in children.items():
        log, _ = child.communicate(timeout=300)
        assert child.returncode == 0, f"{key} failed:\n{log[-3000:]}"
    return out


def _their_compare(target: Path, golden: Path, out: Path):
    import pandas as pd

    out.mkdir(parents=True)
    done = subprocess.run([str(MSPROBE), "compare", "-tp", str(target), "-gp", str(golden), "-o", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (table,) = glob.glob(str(out / "compare_result_*"))
    return pd.read_excel(table) if table.endswith(".xlsx") else pd.read_csv(table)


#: what the predecessor dumps at L1 and we leave out (metadata: `capture.apis.METADATA_PRIMITIVES`, ``shape``)
THEIRS_ONLY = ("Primitive.shape_op.Shape.", "Functional.shape.")
#: the gradient of the data entering the first Dense: we record it, the predecessor does not
OURS_ONLY = "Primitive.matmul.MatMul.0.backward.output.1"


@pytest.mark.parametrize("level", LEVELS)
def test_its_compare_pairs_our_mindspore_dump_with_its_own_both_ways(dumps, tmp_path, level):
    for target, golden in (("ours", "theirs"), ("theirs", "ours")):
        table = _their_compare(dumps[target, level], dumps[golden, level], tmp_path / f"{target}_{level}")
        assert len(table) >= 20 and set(table["Result"]) == {"pass"}
        paired = table[table["Bench Name"].notna()]
        assert (paired["NPU Name"] == paired["Bench Name"]).all()
        unpaired = set(table[table["Bench Name"].isna()]["NPU Name"])
        if level == "L0":
            assert not unpaired and len(paired) >= 19  # parameters_grad.0 included
        elif target == "ours":
            assert unpaired == {OURS_ONLY}
        else:
            assert unpaired and all(name.startswith(THEIRS_ONLY) for name in unpaired)
        errors = paired["NormRelativeErr"].astype(str).str.rstrip("%").astype(float)
        assert (errors < 1e-3).all()  # in percent


@pytest.mark.parametrize("level", LEVELS)
def test_our_compare_pairs_its_mindspore_dump_with_ours(dumps, level):
    from msprobe_engine.analysis import compare_dumps

    comparison = compare_dumps(dumps["theirs", level], dumps["ours", level])
    (rank,) = comparison.ranks
    assert rank.mode == "statistics" and not rank.only_b and not rank.order_fallback
    assert all(name.startswith(THEIRS_ONLY) for name in rank.only_a)
    failing = [(r["entry_a"], r["tensor"]) for r in comparison.rows if r["status"] not in ("pass", "unmatched")]
    assert failing == ([] if level == "L0" else [(OURS_ONLY.rsplit(".", 2)[0], "output.1")])
    assert rank.counts["pass"] >= 19


def test_its_compare_of_our_tensor_dump_with_its_own_is_bitwise_equal(dumps, tmp_path):
    table = _their_compare(dumps["ours", "T"], dumps["theirs", "T"], tmp_path / "tensor")
    paired = table[table["Bench Name"].notna() & (table["NPU Tensor Shape"] != "[]")]  # its cosine: not for scalars
    assert len(paired) >= 45 and set(table["Result"]) == {"pass"}
    assert (paired["Cosine"].astype(float) == 1.0).all() and (paired["MaxAbsErr"].astype(float) == 0.0).all()
