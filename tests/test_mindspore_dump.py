"""The MindSpore dump (L0, PyNative) and the MindSpore incident's dump.json, with real MindSpore on CPU.

The whole file runs a second time in a subprocess where importing torch fails
(`test_dump_runs_without_torch`), without tests/conftest.py (which imports torch).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mindspore import Tensor, nn, ops  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_mindspore import Net, Poison, batches, config, grad_fn_of, make  # noqa: E402

from msprobe_engine.analysis import analyze, compare_dumps  # noqa: E402
from msprobe_engine.errors import ConfigError  # noqa: E402
from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger  # noqa: E402
from msprobe_engine.dump.reader import load_dump, stack_by_entry  # noqa: E402
from msprobe_engine.dump.schema import iter_dump_tensors, validate_dump_json  # noqa: E402
from msprobe_engine.stats import finalize, reference_partial  # noqa: E402
from msprobe_integrations.mindspore import MindSporeMonitor  # noqa: E402

POISON = "Cell.poison.Poison.forward.0"


def run_dump(path, task="statistics", poison_step=None, steps=2, **extra):
    """Train `steps` steps under the dump; returns what the net saw: {step: (x, weights before, grads)}."""
    net, opt = make()
    debugger = MindSporePrecisionDebugger({"task": task, "dump_path": str(path), "level": "L0", "strict": True,
                                           **extra})
    grad_fn = grad_fn_of(net, opt)
    seen = {}
    for step, (x, y) in enumerate(batches(steps)):
        net.poison.poisoned = step == poison_step
        weight = net.fc1.weight.asnumpy().copy()
        debugger.start(net)
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        debugger.stop()
        debugger.step(grads)
        seen[step] = (x, weight, [g.asnumpy() for g in grads])
    debugger.close()
    assert debugger.transfers == steps and not debugger.hook_errors
    return seen


def test_a_statistics_dump_has_the_reference_mindspore_format_and_reads_back(tmp_path):
    seen = run_dump(tmp_path)
    dumps = load_dump(tmp_path)
    assert sorted(dumps) == [(0, None), (1, None)]
    dump = dumps[(1, None)]
    doc = json.loads(dump.dump_json.read_text())
    assert validate_dump_json(doc) == [] and dump.problems == []
    assert (doc["task"], doc["level"], doc["framework"]) == ("statistics", "L0", "mindspore")
    names = list(doc["data"])
    assert names[:4] == ["Cell.fc1.Dense.forward.0", "Cell.act.Tanh.forward.0", POISON, "Cell.fc2.Dense.forward.0"]
    assert {"Cell.fc2.Dense.backward.0", "Cell.fc1.Dense.parameters_grad.0", "Cell.fc2.Dense.parameters_grad.0"} <= set(names)
    for ref in iter_dump_tensors(doc):
        assert ref.record["type"] == "mindspore.Tensor" and ref.record["dtype"] == "Float32"
        assert "requires_grad" not in ref.record and "data_name" not in ref.record
    fc1 = doc["data"]["Cell.fc1.Dense.forward.0"]
    x, weight, grads = seen[1]
    for record, values in [(fc1["input_args"][0], x), (fc1["parameters"]["weight"], weight),  # before the update
                           (doc["data"]["Cell.fc1.Dense.parameters_grad.0"]["weight"][0], grads[0])]:
        want = finalize(reference_partial(values))
        assert record["shape"] == list(values.shape)
        assert (record["Max"], record["Min"]) == (float(want["max"]), float(want["min"]))
        np.testing.assert_allclose([record["Mean"], record["Norm"]], [want["mean"], want["norm"]], rtol=1e-5, atol=1e-7)
    backward = doc["data"]["Cell.fc2.Dense.backward.0"]
    assert backward["input"][0]["shape"] == [5, 3] and backward["output"][0]["shape"] == [5, 8]


def test_a_nan_injected_into_a_cell_is_named_by_analyze_and_compare(tmp_path):
    run_dump(tmp_path / "clean", steps=1)
    run_dump(tmp_path / "bad", steps=1, poison_step=0)
    (result,) = analyze(tmp_path / "bad")
    assert result.first_critical.entry == POISON
    comparison = compare_dumps(tmp_path / "clean", tmp_path / "bad")
    assert comparison.problems == [] and comparison.first_error["entry_a"] == POISON


def test_tensor_task_writes_npy_files_equal_to_the_mindspore_tensors(tmp_path):
    seen = run_dump(tmp_path, task="tensor", steps=1)
    dump = load_dump(tmp_path)[(0, None)]
    assert dump.problems == []
    refs = {ref.label if ref.entry == "Cell.fc1.Dense.forward.0" else (ref.entry, ref.label): ref
            for ref in iter_dump_tensors({"data": dump.data})}
    x, weight, grads = seen[0]
    assert refs["input_args.0"].record["data_name"] == "Cell.fc1.Dense.forward.0.input.0.npy"
    np.testing.assert_array_equal(dump.load_tensor(refs["input_args.0"]), x)
    np.testing.assert_array_equal(dump.load_tensor(refs["parameters.weight"]), weight)
    grad_ref = refs[("Cell.fc1.Dense.parameters_grad.0", "parameters_grad.weight.0")]
    assert grad_ref.record["data_name"] == "Cell.fc1.Dense.parameters_grad.0.weight.npy"
    np.testing.assert_array_equal(dump.load_tensor(grad_ref), grads[0])
    assert all(dump.tensor_file(ref).suffix == ".npy" for ref in iter_dump_tensors({"data": dump.data}))


class Outputs(nn.Cell):
    def construct(self, x):
        return x.astype(ms.bfloat16), x > 0, ops.argmax(x, 1).astype(ms.int64)


class Wrapper(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.out = Outputs()

    def construct(self, x):
        return self.out(x)


def test_dtype_strings_bool_statistics_and_bfloat16_files(tmp_path):
    x = np.array([[0.25, -2.0, 1.5], [3.0, 0.5, -1.0]], np.float32)
    net = Wrapper()
    debugger = MindSporePrecisionDebugger(task="tensor", dump_path=str(tmp_path), level="L0")
    with debugger.step_scope(net):
        net(Tensor(x))
    debugger.close()
    dump = load_dump(tmp_path)[(0, None)]
    bf16, flags, index = dump.data["Cell.out.Outputs.forward.0"]["output"]
    assert (bf16["dtype"], flags["dtype"], index["dtype"]) == ("BFloat16", "Bool", "Int64")
    assert (flags["Max"], flags["Min"], flags["Mean"], flags["Norm"]) == (True, False, None, None)
    assert (index["Max"], index["Min"]) == (2, 0) and isinstance(index["Max"], int)
    refs = list(iter_dump_tensors({"data": dump.data}))
    loaded = dump.load_tensor(refs[1])  # the bfloat16 output, saved as float32
    assert loaded.dtype == np.float32
    np.testing.assert_array_equal(loaded, Tensor(x).astype(ms.bfloat16).astype(ms.float32).asnumpy())


def test_md5_and_config_errors(tmp_path):
    run_dump(tmp_path, steps=1, statistics={"summary_mode": "md5", "list": ["Cell.fc1.Dense"]}, step=[0])
    data = load_dump(tmp_path)[(0, None)].data
    assert set(data) == {"Cell.fc1.Dense.forward.0", "Cell.fc1.Dense.backward.0", "Cell.fc1.Dense.parameters_grad.0"}
    assert all(len(ref.record["md5"]) == 8 for ref in iter_dump_tensors({"data": data}))
    debugger = MindSporePrecisionDebugger(dump_path=str(tmp_path), level="L0",
                                          statistics={"scope": ["Cell.nope.Dense.forward.0", POISON]})
    with pytest.raises(ConfigError, match="no module Cell.nope.Dense"):
        debugger.start(Net())


class ApiNet(nn.Cell):
    """A Dense (MatMul and BiasAdd primitives), then functional and Tensor-method calls, and a Poison."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(6, 8)
        self.poison = Poison()

    def construct(self, x):
        h = ops.relu(self.fc1(x))
        return self.poison(h.sum(axis=1) * 0.5)


def api_dump(path, level, poison=False, **extra):
    ms.set_seed(0)
    net = ApiNet()
    net.poison.poisoned = poison
    x = Tensor(batches(1)[0][0])
    grad_fn = ms.value_and_grad(lambda x: net(x).sum(), None, net.trainable_params())
    debugger = MindSporePrecisionDebugger({"task": "statistics", "dump_path": str(path), "level": level,
                                           "strict": True, **extra})
    with debugger.step_scope(net):
        loss, grads = grad_fn(x)
    debugger.close()
    assert debugger.transfers == 1 and not debugger.hook_errors
    return net, x.asnumpy(), loss


FORWARD_CALLS = ["Primitive.matmul.MatMul.0.forward", "Primitive.bias_add.BiasAdd.0.forward", "Functional.relu.0.forward",
                 "Tensor.sum.0.forward", "Tensor.__mul__.0.forward"]


def test_an_l1_dump_records_primitives_functions_and_tensor_methods_with_their_gradients(tmp_path):
    net, x, _ = api_dump(tmp_path, "L1", stack=True)
    dump = load_dump(tmp_path)[(0, None)]
    assert dump.problems == [] and validate_dump_json(json.loads(dump.dump_json.read_text())) == []
    names = list(dump.data)
    forward = [n for n in names if n.endswith(".forward")]
    assert forward == FORWARD_CALLS + ["Tensor.sum.1.forward"]  # the loss's .sum() in the grad function
    assert {n.replace(".forward", ".backward") for n in FORWARD_CALLS} <= set(names)
    weight, bias = net.fc1.weight.asnumpy(), net.fc1.bias.asnumpy()
    matmul = dump.data["Primitive.matmul.MatMul.0.forward"]
    for record, values in [(matmul["input_args"][0], x), (matmul["input_args"][1], weight),
                           (matmul["output"][0], x @ weight.T),
                           (dump.data["Primitive.bias_add.BiasAdd.0.forward"]["output"][0], x @ weight.T + bias)]:
        want = finalize(reference_partial(values))
        assert record["dtype"] == "Float32" and record["shape"] == list(values.shape)
        np.testing.assert_allclose([record["Max"], record["Min"], record["Mean"], record["Norm"]],
                                   [want["max"], want["min"], want["mean"], want["norm"]], rtol=1e-5, atol=1e-6)
    mul = dump.data["Tensor.__mul__.0.forward"]
    assert mul["input_args"][1] == {"type": "float", "value": 0.5}
    backward = dump.data["Primitive.matmul.MatMul.0.backward"]  # d(loss)/d(output), then per input
    assert [r["shape"] for r in backward["input"]] == [[5, 8]]
    assert [r["shape"] for r in backward["output"]] == [[8, 6], [5, 6]]  # last argument first, as the predecessor
    stacks = stack_by_entry(json.loads((dump.path / "stack.json").read_text()))  # grouped, as the predecessor writes it
    assert set(stacks) == set(forward)
    assert any("test_mindspore_dump.py" in frame and "ops.relu" in frame for frame in stacks["Functional.relu.0.forward"])


def test_a_mix_dump_nests_api_calls_in_their_cells_and_analyze_names_the_first_bad_call(tmp_path):
    api_dump(tmp_path, "mix", poison=True)
    dump = load_dump(tmp_path)[(0, None)]
    construct = json.loads((dump.path / "construct.json").read_text())
    assert construct["Primitive.matmul.MatMul.0.forward"] == "Cell.fc1.Dense.forward.0"
    assert construct["Functional.relu.0.forward"] is None and construct["Cell.fc1.Dense.forward.0"] is None
    assert construct["Primitive.matmul.MatMul.0.backward"] == "Cell.fc1.Dense.backward.0"
    poisoned = [n for n, parent in construct.items() if parent == "Cell.poison.Poison.forward.0"]
    assert poisoned == ["Tensor.__mul__.1.forward"]  # x * nan inside the Poison Cell
    (result,) = analyze(tmp_path)
    assert result.first_critical.entry == "Tensor.__mul__.1.forward"


def test_the_interception_stays_out_of_compiled_code_and_is_undone_at_close(tmp_path):
    originals = (ops.relu, Tensor.__dict__.get("__add__"), "sum" in Tensor.__dict__)
    net = ApiNet()
    prim_class = type(net.fc1.matmul)
    debugger = MindSporePrecisionDebugger(dump_path=str(tmp_path), level="L1", strict=True)
    debugger.start(net)
    assert ops.relu is not originals[0] and type(net.fc1.matmul) is not prim_class
    x = Tensor(np.ones((2, 6), np.float32))
    eager = net(x).asnumpy()
    np.testing.assert_array_equal(ms.jit(net)(x).asnumpy(), eager)  # compiled: the routes compile to plain calls
    debugger.stop()
    debugger.step()
    debugger.close()
    assert (ops.relu, Tensor.__dict__.get("__add__"), "sum" in Tensor.__dict__) == originals
    assert type(net.fc1.matmul) is prim_class
    data = load_dump(tmp_path)[(0, None)].data
    assert [n for n in data if n.endswith("forward")] == FORWARD_CALLS  # the eager call only


def test_l1_and_mix_in_graph_mode_are_refused_naming_the_mode(tmp_path):
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        for level in ("L1", "mix"):
            debugger = MindSporePrecisionDebugger(dump_path=str(tmp_path), level=level)
            with pytest.raises(ConfigError, match=f"level '{level}' needs PYNATIVE_MODE: .* GRAPH_MODE"):
                debugger.start(ApiNet())
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    def old_register_forward_hook(self, hook_fn):  # the signature before with_kwargs
        raise AssertionError("not called")

    with pytest.MonkeyPatch.context() as patch:  # as on an older MindSpore
        patch.setattr(nn.Cell, "register_forward_hook", old_register_forward_hook)
        with pytest.raises(ConfigError, match=r"needs interfaces this MindSpore lacks: mindspore.nn.Cell."
                                              r"register_forward_hook\(..., with_kwargs=True\) \(MindSpore 2"):
            MindSporePrecisionDebugger(dump_path=str(tmp_path), level="mix").start(ApiNet())
    with pytest.raises(ConfigError, match="Functional.nope is not an API"):
        MindSporePrecisionDebugger(dump_path=str(tmp_path), level="L1", list=["Functional.nope.0.forward"]).start(ApiNet())


def test_the_incident_dump_of_a_mindspore_monitor_has_the_mindspore_format(tmp_path):
    net, opt = make()
    monitor = MindSporeMonitor(net, opt, config(tmp_path, alerts=[{"rule": "non_finite", "action": "continue"}]))
    grad_fn = grad_fn_of(net, opt)
    for step, (x, y) in enumerate(batches(2)):
        net.poison.poisoned = step == 1
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        monitor.step_end(loss, grads)
    monitor.close()
    (path,) = tmp_path.glob("incidents/*/dump/step1/proc*/dump.json")
    doc = json.loads(path.read_text())
    assert validate_dump_json(doc) == [] and doc["framework"] == "mindspore"
    assert "Cell.fc1.Dense.parameters_grad" in doc["data"] and POISON in doc["data"]
    for ref in iter_dump_tensors(doc):
        assert ref.record["type"] == "mindspore.Tensor" and ref.record["dtype"] == "Float32"
        assert "requires_grad" not in ref.record
    (result,) = analyze(path.parent)
    assert result.first_critical.entry == POISON


@pytest.mark.slow
def test_dump_runs_without_torch(tmp_path):
    """Every test above, again, in a process where `import torch` fails."""
    script = textwrap.dedent("""
        import sys
        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
        sys.meta_path.insert(0, NoTorch())
        import pytest
        code = pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", "-k", "not without_torch", sys.argv[1]])
        assert "torch" not in sys.modules
        sys.exit(code)
    """)
    result = subprocess.run([sys.executable, "-c", script, __file__], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
