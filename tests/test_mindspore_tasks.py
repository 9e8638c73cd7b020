"""MindSpore overflow_check and free_benchmark with real MindSpore 2.10 on CPU (PyNative).

overflow_check: a net whose ``ops.log`` gets a negative input on purpose in step 1 (nan);
free_benchmark: the variance of values far from their mean (perturbation-sensitive) next to
relu, add and the Dense primitives (stable); grad_probe: the gradients an Adam applies, against
numpy. `test_tasks_run_without_torch` runs the first test of each task again in a process
where importing torch fails (no tests/conftest.py).
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mindspore import Parameter, Tensor, nn, ops  # noqa: E402

from msprobe_engine.analysis import analyze  # noqa: E402
from msprobe_engine.cli import main  # noqa: E402
from msprobe_engine.errors import ConfigError  # noqa: E402
from msprobe_engine.dump.free_benchmark_files import RESULT_CSV  # noqa: E402
from msprobe_engine.dump.reader import find_rank_dirs, load_dump  # noqa: E402
from msprobe_engine.dump.schema import validate_dump_json  # noqa: E402
from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger  # noqa: E402

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)


class LogOf(nn.Cell):
    """``log(x + shift)``: finite for shift 1, nan for shift -100 (the overflow made on purpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = 1.0

    def construct(self, x):
        return ops.log(x + self.shift)


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(4, 6)
        self.act = nn.ReLU()
        self.log = LogOf()
        self.fc2 = nn.Dense(6, 2)

    def construct(self, x):
        return self.fc2(self.log(self.act(self.fc1(x))))


class Spread(nn.Cell):
    """relu (stable) and the variance of values far from their mean (ill-conditioned)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Dense(16, 16)
        self.drop = nn.Dropout(p=0.5)

    def construct(self, x):
        h = self.drop(ops.relu(self.fc(x)))
        return ops.var(ops.add(h, 1e4), axis=-1).mean() + h.mean()


def train(net, config, steps=2, poison_step=None):
    """`steps` SGD steps (under a debugger for `config`); (debugger, losses, parameters after)."""
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((8, 16 if isinstance(net, Spread) else 4)).astype(np.float32))
    y = Tensor(np.zeros((8, 2), np.float32))
    loss_fn = nn.MSELoss()
    forward = (lambda: net(x)) if isinstance(net, Spread) else (lambda: loss_fn(net(x), y))
    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    debugger = MindSporePrecisionDebugger(config) if config else None
    losses = []
    for step in range(steps):
        if isinstance(net, Net):
            net.log.shift = -100.0 if step == poison_step else 1.0
        if debugger:
            debugger.start(net)
        loss, grads = grad_fn()
        opt(grads)
        losses.append(loss.asnumpy())
        if debugger:
            debugger.stop()
            debugger.step(grads)
    if debugger:
        debugger.close()
        assert not debugger.hook_errors
    return debugger, losses, [p.asnumpy() for p in net.trainable_params()]


def made(cls):
    ms.set_seed(0)
    return cls()


def overflow_config(tmp_path, level, **section):
    return {"task": "overflow_check", "dump_path": str(tmp_path), "level": level, "strict": True,
            "overflow_check": section}


# ---- overflow_check ----------------------------------------------------------------------------

@pytest.mark.parametrize("level,first", [("L1", "Functional.log.0.forward"), ("L0", "Cell.log.LogOf.forward.0")])
def test_overflow_check_dumps_only_the_first_call_whose_output_holds_nan(tmp_path, level, first):
    debugger, _, _ = train(made(Net), overflow_config(tmp_path, level), poison_step=1)
    assert debugger.task_results == [(1, first)]
    assert not (tmp_path / "step0").exists()  # a clean step writes nothing
    dumps = load_dump(tmp_path)
    (dump,) = dumps.values()
    doc = json.loads(dump.dump_json.read_text())
    assert validate_dump_json(doc) == [] and dump.problems == []
    assert (doc["task"], doc["level"], doc["framework"]) == ("overflow_check", level, "mindspore")
    assert list(doc["data"]) == [first]  # not fc1/act before it, nor fc2 and the backward after it
    entry = doc["data"][first]
    assert entry["output"][0]["dtype"] == "Float32" and np.isnan(entry["output"][0]["Max"])
    files = sorted(p.name for p in (dump.dump_json.parent / "dump_tensor_data").iterdir())
    assert files == [f"{first}.input.0.npy", f"{first}.output.0.npy"]
    output = np.load(dump.dump_json.parent / "dump_tensor_data" / files[1])
    x = np.load(dump.dump_json.parent / "dump_tensor_data" / files[0])
    assert output.shape == (8, 6) and np.isnan(output).any()
    argument = x if level == "L1" else x - 100.0  # L1: log's input; L0: the Cell's (before the shift)
    np.testing.assert_array_equal(np.isnan(output), argument < 0)
    summary = json.loads((dump.dump_json.parent / "overflow_summary.json").read_text())
    assert summary == {"step": 1, "overflow_nums": 1, "first_overflow": first, "overflowed": [first]}
    (result,) = analyze(dump.dump_json.parent)  # `msprobe-engine analyze` (the predecessor's is PyTorch-only)
    assert result.first_critical.entry == first


def test_overflow_nums_minus_one_dumps_every_overflowing_entry_and_never_the_clean_ones(tmp_path):
    debugger, _, _ = train(made(Net), overflow_config(tmp_path, "L0", overflow_nums=-1), poison_step=1)
    (dump,) = load_dump(tmp_path).values()
    names = list(json.loads(dump.dump_json.read_text())["data"])
    assert names[0] == "Cell.log.LogOf.forward.0" and "Cell.fc2.Dense.forward.0" in names
    assert {"Cell.fc2.Dense.backward.0", "Cell.fc2.Dense.parameters_grad.0", "Cell.fc1.Dense.parameters_grad.0"} \
        <= set(names)  # nan gradients (a parameters_grad entry counts its gradients)
    assert not {"Cell.fc1.Dense.forward.0", "Cell.act.ReLU.forward.0"} & set(names)


def test_a_clean_run_writes_nothing_and_training_is_unchanged(tmp_path):
    _, plain_losses, plain_params = train(made(Net), None)
    debugger, losses, params = train(made(Net), overflow_config(tmp_path, "L1"))
    assert debugger.task_results == [] and not any(tmp_path.iterdir())
    assert all(np.array_equal(a, b) for a, b in zip(plain_losses + plain_params, losses + params))


# ---- free_benchmark ----------------------------------------------------------------------------

def fuzz_config(tmp_path, **section):
    return {"task": "free_benchmark", "dump_path": str(tmp_path), "level": "L1", "strict": True,
            "free_benchmark": section}


def results(tmp_path, step):
    with open(find_rank_dirs(tmp_path / f"step{step}")[0] / RESULT_CSV, newline="") as f:
        return list(csv.DictReader(f))


def test_free_benchmark_flags_the_unstable_api_passes_stable_ones_and_changes_nothing(tmp_path):
    _, plain_losses, plain_params = train(made(Spread), None)
    debugger, losses, params = train(made(Spread), fuzz_config(tmp_path, pert_mode="bit_noise"))
    assert all(np.array_equal(a, b) for a, b in zip(plain_losses + plain_params, losses + params))
    rows = results(tmp_path, 0)
    assert list(rows[0]) == ["rank", "pert_type", "stage", "step", "api_name", "max_rel", "dtype", "shape",
                             "output_index"]  # the predecessor's MindSpore columns
    assert [r["api_name"] for r in rows] == ["Functional.var.0.forward"]  # relu, add, mean, Dense's primitives pass
    row = rows[0]
    assert (row["rank"], row["pert_type"], row["stage"], row["step"], row["dtype"], row["shape"],
            row["output_index"]) == ("", "bit_noise", "forward", "0", "Float32", "(8,)", "")
    assert float(row["max_rel"]) > 2e-4
    assert [r["api_name"] for r in results(tmp_path, 1)] == ["Functional.var.0.forward"]
    assert debugger.transfers == 2 and debugger._recorder.compared >= 10  # ratios: one host copy per step
    assert [r.api_name for r in debugger.task_results] == ["Functional.var.0.forward"] * 2
    assert main(["free-benchmark", str(tmp_path), "--json", str(tmp_path / "fb.json")]) == 0
    report = json.loads((tmp_path / "fb.json").read_text())
    assert [(a["api"], a["steps"]) for a in report] == [("Functional.var", [0, 1])]


def test_free_benchmark_backward_stage_and_list_select_what_is_checked(tmp_path):
    debugger, _, _ = train(made(Spread), fuzz_config(tmp_path, pert_mode="bit_noise", fuzz_stage="backward",
                                                     list=["Functional.var", "Functional.relu"]), steps=1)
    assert debugger._recorder.compared == 2  # var and relu only
    assert [(r.api_name, r.stage) for r in debugger.task_results] == [("Functional.var.0.backward", "backward")]


def test_free_benchmark_fix_replaces_the_output_by_the_more_precise_one_and_gradients_follow(tmp_path):
    class CumSum(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.w = Parameter(Tensor(np.ones(1, np.float32)))

        def construct(self, x):
            return ops.cumsum(x, 0)[-1].astype(ms.float32) * self.w

    net, x = CumSum(), Tensor(np.full(4096, 0.1, np.float16))  # float16 running sums stall at 256
    grad_fn = ms.value_and_grad(net, None, net.trainable_params())
    plain, _ = grad_fn(x)
    debugger = MindSporePrecisionDebugger(fuzz_config(tmp_path, handler_type="fix", list=["Functional.cumsum"]))
    debugger.start(net)
    fixed, (grad,) = grad_fn(x)
    debugger.stop()
    debugger.step()
    debugger.close()
    assert float(plain.asnumpy()[0]) == 256.0
    assert abs(float(fixed.asnumpy()[0]) - 409.6) < 0.5 and abs(float(grad.asnumpy()[0]) - 409.6) < 0.5


@pytest.mark.parametrize("config,message", [
    ({"task": "free_benchmark", "free_benchmark": {"pert_mode": "to_cpu", "fuzz_device": "cpu"}},
     "free_benchmark.pert_mode: 'to_cpu' (with fuzz_device 'cpu') is PyTorch's"),
])
def test_free_benchmark_refuses_what_only_pytorch_runs(tmp_path, config, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MindSporePrecisionDebugger({"dump_path": str(tmp_path), **config})


def test_tasks_need_pynative_mode(tmp_path):
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        for config in (overflow_config(tmp_path, "L0"), fuzz_config(tmp_path)):
            debugger = MindSporePrecisionDebugger(config)
            with pytest.raises(ConfigError, match=f"task '{config['task']}' needs PYNATIVE_MODE"):
                debugger.start(made(Net))
        debugger = MindSporePrecisionDebugger({"task": "grad_probe", "dump_path": str(tmp_path)})
        with pytest.raises(ConfigError, match="task 'grad_probe' needs PYNATIVE_MODE"):
            debugger.monitor(nn.Adam(made(Net).trainable_params()))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def test_tasks_run_without_torch(tmp_path):
    """The first overflow_check, free_benchmark and grad_probe tests again, in a process where
    `import torch` fails."""
    script = textwrap.dedent("""
        import sys
        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
        sys.meta_path.insert(0, NoTorch())
        import pytest
        code = pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", "-k",
                            "L1 or flags_the_unstable or predecessors_files", sys.argv[1]])
        assert "torch" not in sys.modules
        sys.exit(code)
    """)
    result = subprocess.run([sys.executable, "-c", script, __file__], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3 passed" in result.stdout


# ---- grad_probe --------------------------------------------------------------------------------

def probe_run(tmp_path, steps=3, top=None, **section):
    """`steps` Adam steps under grad_probe (monitor(optimizer)); the gradients each step applied."""
    net = made(Net)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    x = Tensor(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32))
    y = Tensor(np.ones((8, 2), np.float32))
    grad_fn = ms.value_and_grad(lambda: nn.MSELoss()(net(x), y), None, opt.parameters)
    debugger = MindSporePrecisionDebugger({"task": "grad_probe", "dump_path": str(tmp_path), "strict": True,
                                           "grad_probe": section, **(top or {})})
    debugger.monitor(opt)
    applied = []
    for _ in range(steps):
        _, grads = grad_fn()
        applied.append({p.name: g.asnumpy() for p, g in zip(opt.parameters, grads)})
        opt(grads)
    debugger.close()
    assert not debugger.hook_errors
    return debugger, applied


def test_grad_probe_writes_the_predecessors_files_from_the_gradients_the_optimizer_applies(tmp_path):
    debugger, applied = probe_run(tmp_path, grad_level="L2", bounds=[-0.01, 0, 0.01], param_list=["fc1.weight",
                                                                                                   "fc2.bias"])
    assert debugger.transfers == 3 and debugger._recorder.steps_written == 3
    for step, grads in enumerate(applied):
        with open(tmp_path / "rank0" / f"grad_summary_{step}.csv", newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["param_name", "(-inf, -0.01]", "(-0.01, 0]", "(0, 0.01]", "(0.01, inf)", "=0",
                           "max", "min", "norm", "shape"]
        assert [r[0] for r in rows[1:]] == ["fc1.weight", "fc2.bias"]
        for row in rows[1:]:
            g = grads[row[0]].astype(np.float64)
            shares = [np.mean(g <= -0.01), np.mean((g > -0.01) & (g <= 0)), np.mean((g > 0) & (g <= 0.01)),
                      np.mean(g > 0.01), np.mean(g == 0)]
            np.testing.assert_allclose([float(v) for v in row[1:6]], shares, atol=1e-12)
            np.testing.assert_allclose([float(v) for v in row[6:9]], [g.max(), g.min(), np.linalg.norm(g)],
                                       rtol=1e-6)
            assert json.loads(row[9]) == list(g.shape)
            direction = np.load(tmp_path / "rank0" / f"step{step}" / f"{row[0]}.npy")
            np.testing.assert_array_equal(direction, g > 0)


def test_grad_probe_step_selection_and_bad_input(tmp_path):
    probe_run(tmp_path / "some", top={"step": [0, 2]}, grad_level="L0")
    assert sorted(p.name for p in (tmp_path / "some" / "rank0").iterdir()) == [
        "grad_summary_0.csv", "grad_summary_2.csv"]  # optimizer steps 0 and 2; L0: no directions
    with open(tmp_path / "some" / "rank0" / "grad_summary_2.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["param_name", "MD5", "max", "min", "norm", "shape"] and len(rows) == 5  # every parameter
    debugger = MindSporePrecisionDebugger({"task": "grad_probe", "dump_path": str(tmp_path / "bad"),
                                           "grad_probe": {"param_list": ["fc1.weigth"]}})
    net = made(Net)
    with pytest.raises(ConfigError, match="has no parameter 'fc1.weigth' \\(did you mean 'fc1.weight'\\?\\)"):
        debugger.monitor(nn.Adam(net.trainable_params()))
    with pytest.raises(ConfigError, match="watches the optimizer"):
        MindSporePrecisionDebugger({"task": "grad_probe", "dump_path": str(tmp_path / "net")}).monitor(net)


def test_grad_probe_under_model_train(tmp_path):
    import mindspore.dataset as ds
    from mindspore.train import Model

    net = made(Net)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((3, 2)).astype(np.float32))
            for _ in range(3)]
    debugger = MindSporePrecisionDebugger({"task": "grad_probe", "dump_path": str(tmp_path), "strict": True})
    debugger.monitor(opt)  # the optimizer is called inside the train network
    Model(net, nn.MSELoss(), opt).train(1, ds.GeneratorDataset(lambda: iter(data), ["x", "y"], shuffle=False),
                                        dataset_sink_mode=False)
    debugger.close()
    assert sorted(p.name for p in (tmp_path / "rank0").glob("grad_summary_*.csv")) == [
        "grad_summary_0.csv", "grad_summary_1.csv", "grad_summary_2.csv"]
    assert main(["grad-probe", str(tmp_path), "-o", str(tmp_path / "similarities")]) == 0  # the verb reads them
    assert (tmp_path / "similarities" / "rank0" / "similarities.csv").is_file()
