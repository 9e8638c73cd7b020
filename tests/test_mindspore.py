"""The MindSpore integration with real MindSpore on CPU (PyNative unless a test says otherwise).

Tolerance against the numpy float64 reference (`stats.reference_partial`): min, max,
the nan/inf/zero counts and numel are exact; mean and norm within rtol 1e-5 (float32
accumulation), plus atol 1e-5 x mean|x| for means close to zero.

The whole file runs a second time in a subprocess where importing torch fails
(`test_runs_without_torch`), without tests/conftest.py (which imports torch).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mindspore as ms  # noqa: E402
import mindspore.dataset as ds  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mindspore import Tensor, nn  # noqa: E402
from mindspore.train import Callback, Model  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from msprobe_engine.frameworks.mindspore import backend as mindspore_backend  # noqa: E402
from msprobe_engine.incident.actions import TrainingStopped  # noqa: E402
from msprobe_engine.stats import finalize, reference_partial  # noqa: E402
from msprobe_integrations.mindspore import MindSporeMonitor, MonitorCallback  # noqa: E402
from sink_helpers import EVERY_TAG_TENSORBOARD  # noqa: E402

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)

STATS = ["min", "max", "mean", "norm", "nan_count", "inf_count"]
EVERYTHING = {"module_outputs": True, "module_inputs": True, "activation_grads": True, "param_grads": True,
              "params": True, "optimizer_state": ["exp_avg", "exp_avg_sq", "update", "ratio"]}


class Poison(nn.Cell):
    """Passes its input through; multiplies it by nan while `poisoned` (the injected fault)."""

    def __init__(self) -> None:
        super().__init__()
        self.poisoned = False

    def construct(self, x):
        return x * float("nan") if self.poisoned else x


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(6, 8)
        self.act = nn.Tanh()
        self.poison = Poison()
        self.fc2 = nn.Dense(8, 3)

    def construct(self, x):
        return self.fc2(self.poison(self.act(self.fc1(x))))


def make(optimizer=nn.Adam):
    ms.set_seed(0)
    net = Net()
    return net, optimizer(net.trainable_params(), learning_rate=0.01)


def batches(n: int = 3):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32))
            for _ in range(n)]


def dataset(n: int = 3):
    return ds.GeneratorDataset(lambda: iter(batches(n)), ["x", "y"], shuffle=False)


def config(tmp_path, watch=None, **extra):
    return {"output_dir": str(tmp_path), "strict": True, "sinks": ["jsonl"], "stats": STATS,
            "watch": watch or EVERYTHING, **extra}


def grad_fn_of(net, optimizer):
    loss_fn = nn.MSELoss()

    def forward(x, y):
        return loss_fn(net(x), y)

    return ms.value_and_grad(forward, None, optimizer.parameters)


def assert_stats(metrics: dict, prefix: str, values: np.ndarray) -> None:
    """The monitor's statistics `prefix/<stat>` against the numpy float64 reference."""
    want = finalize(reference_partial(values))
    for stat in ("min", "max", "nan_count", "inf_count"):
        np.testing.assert_array_equal(metrics[f"{prefix}/{stat}"], want[stat], err_msg=f"{prefix}/{stat}")
    atol = 1e-5 * float(np.abs(values.astype(np.float64)).mean()) if values.size else 0.0
    np.testing.assert_allclose(metrics[f"{prefix}/mean"], want["mean"], rtol=1e-5, atol=atol, err_msg=prefix)
    np.testing.assert_allclose(metrics[f"{prefix}/norm"], want["norm"], rtol=1e-5, err_msg=prefix)


# ---- the backend ------------------------------------------------------------------------------

def test_backend_rows_equal_the_numpy_reference_for_every_dtype_and_size():
    rng = np.random.default_rng(1)
    arrays = [(rng.standard_normal(n) * 3 + 0.5).astype(np.float32) for n in (1, 7, 1000, 40_000)]
    arrays += [np.float32(2.5), rng.standard_normal((3, 4)), rng.integers(-5, 5, 40), np.array([True, False, True]),
               np.zeros(10, np.float32), np.zeros((0, 3), np.float32), np.array([0.5, -2, 0], np.float16),
               (rng.standard_normal(mindspore_backend.LARGE_NUMEL + 3) * 2).astype(np.float32)]
    tensors = [Tensor(a) for a in arrays] + [Tensor(arrays[2]).astype(ms.bfloat16)]
    arrays.append(tensors[-1].astype(ms.float32).asnumpy())
    tensors.append(tensors[1])  # the same tensor twice: reduced once, reported twice
    arrays.append(arrays[1])
    rows = mindspore_backend.to_host(mindspore_backend.partial_stats(tensors, count_zeros=True))
    assert rows.shape == (len(tensors), 8) and rows.dtype == np.float64
    for row, values in zip(rows, arrays):
        got, want = finalize(row), finalize(reference_partial(values))
        for stat in ("min", "max", "nan_count", "inf_count", "zero_frac", "numel"):
            np.testing.assert_array_equal(got[stat], want[stat], err_msg=f"{stat} of {values.dtype}{values.shape}")
        atol = 1e-5 * float(np.abs(np.asarray(values, np.float64)).mean()) if np.size(values) else 0.0
        np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-5, atol=atol, equal_nan=True)
        np.testing.assert_allclose(got["norm"], want["norm"], rtol=1e-5, equal_nan=True)


def test_backend_follows_ieee_semantics_and_the_zero_count_is_only_taken_on_request():
    arrays = [np.array([1, np.nan, 3, np.nan], np.float32), np.array([1, np.inf, -np.inf], np.float32),
              np.full(4, -np.inf, np.float32), np.array([np.nan, np.inf]), np.zeros(0, np.float32),
              np.array([0.0, 2.0], np.float32)]
    rows = mindspore_backend.to_host(mindspore_backend.partial_stats([Tensor(a) for a in arrays]))
    stats = finalize(rows)
    assert np.isnan(stats["min"][0]) and np.isnan(stats["max"][0]) and np.isnan(stats["norm"][0])
    assert stats["min"][1] == -np.inf and stats["max"][1] == np.inf and np.isnan(stats["mean"][1])
    assert stats["min"][2] == stats["max"][2] == -np.inf and stats["norm"][2] == np.inf
    assert list(stats["nan_count"]) == [2, 0, 0, 1, 0, 0] and list(stats["inf_count"]) == [0, 2, 4, 1, 0, 0]
    assert rows[4].tolist()[:2] == [np.inf, -np.inf] and stats["numel"][4] == 0  # merge identities
    assert np.isnan(rows[5, 6]) and rows[4, 6] == 0  # zero count not asked for: nan (0 when empty, as torch)
    assert mindspore_backend.to_host(mindspore_backend.partial_stats([])).shape == (0, 8)


# ---- a training loop ---------------------------------------------------------------------------

def test_a_value_and_grad_step_equals_a_numpy_reference(tmp_path):
    net, opt = make()
    monitor = MindSporeMonitor(net, opt, config(tmp_path))
    outputs = {}

    def keep(name):
        def hook(cell, args, output):
            outputs[name] = output.asnumpy()
        return hook

    for name, cell in net.cells_and_names():
        if name:
            cell.register_forward_hook(keep(name))
    grad_fn = grad_fn_of(net, opt)
    x, y = batches(1)[0]
    params_before = {p.name: p.asnumpy().copy() for p in opt.parameters}
    loss, grads = grad_fn(Tensor(x), Tensor(y))
    opt(grads)
    metrics = monitor.step_end(loss, grads).metrics
    monitor.close()

    assert metrics["train/loss"] == pytest.approx(float(loss.asnumpy()), rel=1e-6)
    assert_stats(metrics, "actv/fc1/input.0", x)
    for name, values in outputs.items():
        assert_stats(metrics, f"actv/{name}/output", values)
    for p, g, m, v in zip(opt.parameters, grads, opt.moment1, opt.moment2):
        assert_stats(metrics, f"grad/{p.name}", g.asnumpy())
        assert_stats(metrics, f"param/{p.name}", p.asnumpy())
        assert_stats(metrics, f"optim/{p.name}/exp_avg", m.asnumpy())
        assert_stats(metrics, f"optim/{p.name}/exp_avg_sq", v.asnumpy())
        update = p.asnumpy() - params_before[p.name]
        assert_stats(metrics, f"optim/{p.name}/update", update)
        assert metrics[f"optim/{p.name}/ratio"] == pytest.approx(
            np.linalg.norm(update.astype(np.float64)) / np.linalg.norm(p.asnumpy().astype(np.float64)), rel=1e-5)
    global_norm = np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in grads))
    assert metrics["grad/global/norm"] == pytest.approx(global_norm, rel=1e-5)
    assert {k.split("/")[1] for k in metrics if k.startswith("actv_grad/")} == {"fc1", "act", "poison", "fc2"}


def test_monitor_attach_wires_a_cell_as_the_integration_does(tmp_path):
    """`Monitor(config).attach(net, optimizer)` (the framework's `attach`) records what
    `MindSporeMonitor` records, bit for bit, and `detach` takes every hook out."""
    from msprobe_engine.monitor import Monitor

    records = {}
    for how in ("integration", "attach"):
        net, opt = make()
        cfg = config(tmp_path / how)
        monitor = MindSporeMonitor(net, opt, cfg) if how == "integration" else Monitor(cfg).attach(net, opt)
        grad_fn = grad_fn_of(net, opt)
        for x, y in batches(2):
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
            monitor.step_end(loss)
        monitor.close()
        records[how] = [r.metrics for r in monitor.history]
        assert not any(cell._forward_hook for _, cell in net.cells_and_names())
    assert {k for k in records["attach"][0] if k.startswith(("actv/", "grad/", "optim/"))}
    drop = ("monitor/", "Health/monitor_ms")  # the monitor's own timings
    assert [{k: v for k, v in m.items() if not k.startswith(drop)} for m in records["attach"]] == \
        [{k: v for k, v in m.items() if not k.startswith(drop)} for m in records["integration"]]


def test_gradients_of_cell_outputs_and_repeated_calls_are_named_per_call(tmp_path):
    class Twice(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Dense(4, 4)

        def construct(self, x):
            return self.shared(self.shared(x))

    ms.set_seed(0)
    net = Twice()
    opt = nn.SGD(net.trainable_params(), 0.1)
    monitor = MindSporeMonitor(net, opt, config(tmp_path, {"module_outputs": True, "activation_grads": True,
                                                           "optimizer_state": []}))
    grad_fn = ms.value_and_grad(lambda x: net(x).sum(), None, opt.parameters)
    loss, grads = grad_fn(Tensor(np.ones((2, 4), np.float32)))
    opt(grads)
    metrics = monitor.step_end(loss).metrics
    monitor.close()
    assert "actv/shared/output/norm" in metrics and "actv/shared:1/output/norm" in metrics
    # d(sum of the last output)/d(last output) is all ones
    assert metrics["actv_grad/shared:1/output/min"] == metrics["actv_grad/shared:1/output/max"] == 1.0
    assert metrics["actv_grad/shared:1/output/norm"] == pytest.approx(np.sqrt(8))
    assert "actv_grad/shared/output/norm" in metrics


def test_losses_are_bitwise_identical_with_the_monitor_and_one_transfer_per_monitored_step(tmp_path):
    losses = {}
    for monitored in (False, True):
        net, opt = make()
        grad_fn = grad_fn_of(net, opt)
        monitor = MindSporeMonitor(net, opt, config(tmp_path, schedule={"interval": 2})) if monitored else None
        losses[monitored] = []
        for x, y in batches(5):
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
            if monitor is not None:
                monitor.step_end(loss, grads)
            losses[monitored].append(loss.asnumpy().tobytes())
        if monitor is not None:
            monitor.close()
            assert monitor.monitor.transfers == 3  # steps 0, 2, 4
            assert [r.step for r in monitor.monitor.history] == [0, 2, 4]
    assert losses[True] == losses[False]


@pytest.mark.parametrize("action", ["continue", "skip"])
def test_nan_injected_into_a_named_cell_is_named_by_the_non_finite_alert(tmp_path, caplog, action):
    caplog.set_level(logging.WARNING, logger="msprobe_engine")
    net, opt = make()
    monitor = MindSporeMonitor(net, opt, config(tmp_path, alerts=[{"rule": "non_finite", "action": action}]))
    grad_fn = grad_fn_of(net, opt)
    for step, (x, y) in enumerate(batches(3)):
        net.poison.poisoned = step == 2
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        monitor.step_end(loss, grads)
    monitor.close()  # with a pre-step decision ("skip") the last record is emitted here
    records = {r.step: r for r in monitor.monitor.history}
    assert not records[1].alerts
    starts = [a for a in records[2].alerts if a.phase == "start"]
    assert (starts[0].rule, starts[0].tag) == ("non_finite", "actv/poison/output/nan_count")
    if action == "skip":  # the nan step was not applied: the parameters after it are finite
        assert not [a.tag for a in starts if a.tag.startswith(("param/", "optim/"))]
    assert records[2].metrics["actv/act/output/nan_count"] == 0  # the cell before it was still fine
    params_finite = all(np.isfinite(p.asnumpy()).all() for p in opt.parameters)
    assert params_finite == (action == "skip")


def optimizer_values(opt) -> dict[str, np.ndarray]:
    """Every Parameter of the optimizer Cell: weights, moments, step counters, beta powers."""
    return {name: p.asnumpy().copy() for name, p in opt.parameters_and_names()}


class Recorder(Callback):
    """Poisons the net at `poison_step` and keeps the optimizer's values around every step."""

    def __init__(self, net, opt, poison_step: int) -> None:
        super().__init__()
        self.net, self.opt, self.poison_step = net, opt, poison_step
        self.seen: list[tuple[dict, dict]] = []

    def on_train_step_begin(self, run_context):
        self.net.poison.poisoned = len(self.seen) == self.poison_step
        self.before = optimizer_values(self.opt)

    def on_train_step_end(self, run_context):
        self.seen.append((self.before, optimizer_values(self.opt)))


@pytest.mark.parametrize("loop", ["value_and_grad", "Model.train"])
def test_skip_leaves_weights_moments_and_step_counters_of_the_skipped_step_unchanged(tmp_path, loop):
    net, opt = make()
    cfg = config(tmp_path, alerts=[{"rule": "non_finite", "action": "skip"}])
    recorder = Recorder(net, opt, poison_step=1)
    if loop == "Model.train":
        callback = MonitorCallback(net, opt, config=cfg)
        Model(net, nn.MSELoss(), opt).train(1, dataset(3), callbacks=[recorder, callback], dataset_sink_mode=False)
        monitor = callback.monitor
    else:
        monitor = MindSporeMonitor(net, opt, cfg)
        grad_fn = grad_fn_of(net, opt)
        for x, y in batches(3):
            recorder.on_train_step_begin(None)
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
            monitor.step_end(loss, grads)
            recorder.on_train_step_end(None)
        monitor.close()
    assert len(recorder.seen) == 3 and {"moment1.fc1.weight", "global_step", "beta1_power"} <= set(recorder.seen[0][0])
    for step, (before, after) in enumerate(recorder.seen):
        changed = {name for name in before if not np.array_equal(before[name], after[name])}
        if step == 1:  # skipped: bitwise unchanged
            assert changed == set(), changed
        else:
            assert {"fc1.weight", "moment1.fc2.bias", "moment2.fc1.weight", "global_step", "beta1_power"} <= changed
    records = {r.step: r for r in monitor.monitor.history}
    assert {(a.rule, a.step) for a in records[1].alerts if a.phase == "start"} == {("non_finite", 1)}
    assert records[1].metrics["optim/fc1.weight/update/norm"] == 0.0  # measured after the undo
    assert all(np.isfinite(p.asnumpy()).all() for p in opt.parameters)


def test_the_monitor_adds_no_mindspore_kernel_warnings(tmp_path, capfd):
    net, opt = make()
    monitor = MindSporeMonitor(net, opt, config(tmp_path))
    grad_fn = grad_fn_of(net, opt)
    for x, y in batches(2):
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        opt(grads)
        monitor.step_end(loss, grads)
    monitor.close()
    err = capfd.readouterr().err
    assert "KERNEL" not in err and "For 'Cast'" not in err, err[-2000:]


def test_a_stop_rule_stops_the_training_before_the_optimizer_step(tmp_path):
    net, opt = make()
    monitor = MindSporeMonitor(net, opt, config(tmp_path, alerts=[{"rule": "non_finite", "action": "stop"}]))
    grad_fn = grad_fn_of(net, opt)
    (x, y), = batches(1)
    net.poison.poisoned = True
    loss, grads = grad_fn(Tensor(x), Tensor(y))
    before = opt.parameters[0].asnumpy().copy()
    with pytest.raises(TrainingStopped, match="non_finite"):
        opt(grads)
    np.testing.assert_array_equal(opt.parameters[0].asnumpy(), before)  # the weights did not change
    monitor.close()


# ---- Model.train and TensorBoard ------------------------------------------------------------

def test_model_train_callback_writes_tensorboard_that_reads_back(tmp_path):
    net, opt = make()
    callback = MonitorCallback(net, opt, config=config(tmp_path, sinks=[EVERY_TAG_TENSORBOARD, "jsonl"]))
    Model(net, nn.MSELoss(), opt).train(1, dataset(3), callbacks=[callback], dataset_sink_mode=False)
    history = list(callback.monitor.monitor.history)  # closed at the end of train
    assert [r.step for r in history] == [0, 1, 2] and all(r.micro_steps == 1 for r in history)
    events = EventAccumulator(str(tmp_path / "rank0"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "grad/global/norm", "actv/fc1/output/norm", "actv_grad/fc2/output/max",
                "grad/fc1.weight/norm", "param/fc2.bias/mean", "optim/fc1.weight/exp_avg/norm",
                "optim/fc1.weight/exp_avg_sq/max", "optim/fc1.weight/update/norm", "optim/fc1.weight/ratio"):
        assert tag in tags, tag
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [0, 1, 2]
        np.testing.assert_allclose([s.value for s in scalars], [r.metrics[tag] for r in history], rtol=1e-6)


def test_graph_mode_says_what_it_measures_and_monitors_activations_loss_gradients_and_optimizer_state(tmp_path,
                                                                                                      caplog):
    caplog.set_level(logging.WARNING, logger="msprobe_engine")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        net, opt = make()
        callback = MonitorCallback(net, opt, config=config(tmp_path / "grads"))
        assert "GRAPH_MODE" in caplog.text and "measured inside the compiled graph" in caplog.text
        train_net = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt, return_grad=True)
        Model(train_net).train(1, dataset(2), callbacks=[callback], dataset_sink_mode=False)
        history = list(callback.monitor.monitor.history)
        assert [r.step for r in history] == [0, 1]
        metrics = history[-1].metrics
        assert metrics["actv/fc1/output/norm"] > 0 and metrics["actv_grad/fc2/output/norm"] > 0  # in-graph taps
        for tag in ("train/loss", "grad/global/norm", "grad/fc1.weight/norm", "optim/fc2.weight/exp_avg/norm",
                    "optim/fc2.weight/exp_avg_sq/norm", "param/fc1.bias/norm", "optim/fc1.weight/ratio"):
            assert np.isfinite(metrics[tag]) and metrics[tag] > 0, tag
        np.testing.assert_allclose(metrics["optim/fc2.weight/exp_avg/norm"],
                                   np.linalg.norm(opt.moment1[2].asnumpy().astype(np.float64)), rtol=1e-5)

        caplog.clear()  # the default train network does not hand out its gradients: the optimizer's tap measures them
        net, opt = make()
        callback = MonitorCallback(net, opt, config=config(tmp_path / "no_grads"))
        Model(net, nn.MSELoss(), opt).train(1, dataset(2), callbacks=[callback], dataset_sink_mode=False)
        assert "parameter gradients are not monitored" not in caplog.text
        metrics = callback.monitor.monitor.history[-1].metrics
        assert metrics["grad/fc1.weight/norm"] > 0 and "optim/fc2.weight/exp_avg/norm" in metrics
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def test_a_compiled_train_step_in_pynative_measures_activations_in_the_graph(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe_engine")
    net, opt = make()
    monitor = MindSporeMonitor(net, opt, config(tmp_path))
    grad_fn = grad_fn_of(net, opt)

    @ms.jit
    def train_step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss, grads

    for x, y in batches(2):
        loss, grads = train_step(Tensor(x), Tensor(y))
        record = monitor.step_end(loss, grads)
    monitor.close()
    assert "no statistics came from the compiled graph" not in caplog.text
    assert record.metrics["actv/fc1/output/norm"] > 0 and record.metrics["actv_grad/fc2/output/norm"] > 0
    assert "grad/fc1.weight/norm" in record.metrics and "optim/fc1.weight/exp_avg/norm" in record.metrics
    np.testing.assert_allclose(record.metrics["grad/fc1.weight/norm"],
                               np.linalg.norm(grads[0].asnumpy().astype(np.float64)), rtol=1e-5)


# ---- bad input ------------------------------------------------------------------------------------

def test_bad_input_names_what_is_not_monitored(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe_engine")
    net, opt = make()
    with pytest.raises(TypeError, match="net must be a mindspore.nn.Cell, got dict"):
        MindSporeMonitor({}, opt, config(tmp_path))
    with pytest.raises(TypeError, match="optimizer must be a mindspore.nn.Optimizer .* got str"):
        MonitorCallback(net, "adam", config=config(tmp_path))

    net, sgd = make(nn.SGD)
    monitor = MindSporeMonitor(net, sgd, config(tmp_path))
    assert "state of optimizer SGD is not known; exp_avg, exp_avg_sq are not monitored" in caplog.text
    grad_fn = grad_fn_of(net, sgd)
    x, y = batches(1)[0]
    loss, grads = grad_fn(Tensor(x), Tensor(y))
    sgd(grads)
    metrics = monitor.step_end(loss).metrics
    assert "grad/fc1.weight/norm" in metrics and "optim/fc1.weight/ratio" in metrics
    assert not [k for k in metrics if "exp_avg" in k]

    monitor.optim.remove()  # as if the optimizer ran compiled: the gradients come from step_end
    monitor.step_end(loss, grads[:1])
    monitor.close()
    assert "got 1 gradients for 4 parameters; gradients are not monitored" in caplog.text


# ---- without torch ----------------------------------------------------------------------------

@pytest.mark.slow
def test_runs_without_torch(tmp_path):
    """Every test above, again, in a process where `import torch` fails."""
    script = textwrap.dedent("""
        import sys

        class BlockTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError(f"importing {name} is blocked in this test")

        sys.meta_path.insert(0, BlockTorch())
        import pytest
        code = pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", "-k", "not without_torch", sys.argv[1]])
        assert "torch" not in sys.modules
        sys.exit(code)
    """)
    result = subprocess.run([sys.executable, "-c", script, __file__], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
