"""A MindSpore dump and a PyTorch dump of the same model (same weights, same input) compare entry
by entry: Cells pair with Modules (L0), MindSpore APIs with PyTorch's (L1), through
`msprobe_engine.analysis.framework_map`. Real MindSpore 2.10 and torch 2.13 on CPU, in one process.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from mindspore import Parameter, Tensor, mint, nn, ops  # noqa: E402

from msprobe_engine.analysis import compare_dumps  # noqa: E402
from msprobe_engine.dump import PrecisionDebugger  # noqa: E402
from msprobe_engine.dump.reader import load_dump  # noqa: E402
from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger  # noqa: E402

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)
pytestmark = pytest.mark.slow  # both frameworks in one process, four dumps

RNG = np.random.default_rng(0)
WEIGHTS = {"fc1.weight": RNG.standard_normal((8, 6)) * 0.4, "fc1.bias": RNG.standard_normal(8) * 0.1,
           "norm.gamma": 1 + RNG.standard_normal(8) * 0.1, "norm.beta": RNG.standard_normal(8) * 0.1,
           "body.0.weight": RNG.standard_normal((3, 8)) * 0.4, "body.0.bias": RNG.standard_normal(3) * 0.1}
X = RNG.standard_normal((5, 6)).astype(np.float32)


def f32(name: str) -> np.ndarray:
    return WEIGHTS[name].astype(np.float32)


class MsLayers(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(6, 8, weight_init=Tensor(f32("fc1.weight")), bias_init=Tensor(f32("fc1.bias")))
        self.act = nn.Tanh()
        self.norm = nn.LayerNorm((8,), gamma_init=Tensor(f32("norm.gamma")), beta_init=Tensor(f32("norm.beta")))
        self.body = nn.SequentialCell(nn.Dense(8, 3, weight_init=Tensor(f32("body.0.weight")),
                                               bias_init=Tensor(f32("body.0.bias"))), nn.ReLU())

    def construct(self, x):
        return self.body(self.norm(self.act(self.fc1(x))))


class TorchLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.act = torch.nn.Tanh()
        self.norm = torch.nn.LayerNorm(8)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.ReLU())
        names = {"norm.weight": "norm.gamma", "norm.bias": "norm.beta"}
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.from_numpy(f32(names.get(name, name))))

    def forward(self, x):
        return self.body(self.norm(self.act(self.fc1(x))))


class MsFunctional(nn.Cell):
    """The same computation as `TorchFunctional`, with MindSpore's functional APIs."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = Parameter(Tensor(f32("fc1.weight")), name="w1"), Parameter(Tensor(f32("fc1.bias")), name="b1")
        self.w2 = Parameter(Tensor(f32("body.0.weight").T.copy()), name="w2")

    def construct(self, x):
        h = ops.relu(ops.dense(x, self.w1, self.b1))           # Functional.dense -> Functional.linear
        h = mint.tanh(h) * 2.0                                  # Mint.tanh -> Torch.tanh; Tensor.__mul__
        return ops.softmax(mint.matmul(h, self.w2), axis=-1)    # Mint.matmul -> Torch.matmul


class TorchFunctional(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.from_numpy(f32("fc1.weight")))
        self.b1 = torch.nn.Parameter(torch.from_numpy(f32("fc1.bias")))
        self.w2 = torch.nn.Parameter(torch.from_numpy(f32("body.0.weight").T.copy()))

    def forward(self, x):
        h = torch.nn.functional.relu(torch.nn.functional.linear(x, self.w1, self.b1))
        h = torch.tanh(h) * 2.0
        return torch.nn.functional.softmax(torch.matmul(h, self.w2), dim=-1)


def ms_dump(path, net, level):
    debugger = MindSporePrecisionDebugger(task="statistics", dump_path=str(path), level=level, strict=True)
    grad_fn = ms.value_and_grad(lambda x: (net(x) * Tensor(WEIGHTS_OUT)).sum(), None, net.trainable_params())
    debugger.start(net)
    _, grads = grad_fn(Tensor(X))
    debugger.stop()
    debugger.step(grads)  # the parameter gradients (MindSpore has no per-parameter hook)
    debugger.close()


def torch_dump(path, model, level):
    debugger = PrecisionDebugger(task="statistics", dump_path=str(path), level=level, strict=True)
    with debugger.step_scope(model):
        # MindSpore's API backward hooks see the gradient of an input that needs none (its Cell hooks do not)
        x = torch.from_numpy(X).requires_grad_(level == "L1")
        (model(x) * torch.from_numpy(WEIGHTS_OUT)).sum().backward()
    debugger.close()


WEIGHTS_OUT = RNG.standard_normal((5, 3)).astype(np.float32)  # d(loss)/d(output): not all ones


#: API backward entries whose input gradients the frameworks record in another order: PyTorch the
#: order of autograd's edges (linear: bias, input, weight transposed), MindSpore its arguments' order
GRADIENTS_IN_ANOTHER_ORDER = {"Functional.dense.0.backward"}


def assert_every_entry_pairs_and_passes(ms_path, torch_path, expected):
    comparison = compare_dumps(ms_path, torch_path)
    (rank,) = comparison.ranks
    assert comparison.problems == [] and rank.only_a == [] and rank.only_b == [], (rank.only_a, rank.only_b)
    bad = [(r["entry_a"], r["tensor"], r["status"], r["reason"]) for r in comparison.rows
           if r["status"] != "pass" and r["entry_a"] not in GRADIENTS_IN_ANOTHER_ORDER]
    assert bad == []
    pairs = {(r["entry_a"], r["entry_b"]) for r in comparison.rows}
    assert expected <= pairs
    ms_entries = load_dump(ms_path)[(0, None)].data
    assert {a for a, _ in pairs} == set(ms_entries)  # every MindSpore entry found its PyTorch one
    return comparison


def test_cells_pair_with_modules_forward_backward_and_parameter_gradients(tmp_path):
    ms_dump(tmp_path / "ms", MsLayers(), "L0")
    torch_dump(tmp_path / "torch", TorchLayers(), "L0")
    comparison = assert_every_entry_pairs_and_passes(tmp_path / "ms", tmp_path / "torch", {
        ("Cell.fc1.Dense.forward.0", "Module.fc1.Linear.forward.0"),
        ("Cell.norm.LayerNorm.backward.0", "Module.norm.LayerNorm.backward.0"),
        ("Cell.body.SequentialCell.forward.0", "Module.body.Sequential.forward.0"),
        ("Cell.body.0.Dense.parameters_grad.0", "Module.body.0.Linear.parameters_grad.0"),
        ("Cell.body.1.ReLU.backward.0", "Module.body.1.ReLU.backward.0")})
    labels = {r["tensor"] for r in comparison.rows if r["entry_a"] == "Cell.norm.LayerNorm.parameters_grad.0"}
    assert labels == {"parameters_grad.weight.0", "parameters_grad.bias.0"}  # gamma/beta under torch's names
    rows = comparison.rows
    assert len(rows) > 30 and all(r["Norm_a"] is not None and r["Norm_b"] is not None for r in rows)
    assert max(r["Norm_rel_err"] for r in rows) < 1e-4


def test_mindspore_apis_pair_with_their_pytorch_counterparts(tmp_path):
    ms_dump(tmp_path / "ms", MsFunctional(), "L1")
    torch_dump(tmp_path / "torch", TorchFunctional(), "L1")
    assert_every_entry_pairs_and_passes(tmp_path / "ms", tmp_path / "torch", {
        ("Functional.dense.0.forward", "Functional.linear.0.forward"),
        ("Functional.dense.0.backward", "Functional.linear.0.backward"),
        ("Functional.relu.0.forward", "Functional.relu.0.forward"),
        ("Mint.tanh.0.forward", "Torch.tanh.0.forward"),
        ("Tensor.__mul__.0.backward", "Tensor.__mul__.0.backward"),
        ("Mint.matmul.0.forward", "Torch.matmul.0.forward"),
        ("Functional.softmax.0.backward", "Functional.softmax.0.backward")})
