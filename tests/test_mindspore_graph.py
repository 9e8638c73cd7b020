"""Activation statistics measured inside compiled MindSpore graphs (real MindSpore 2.10, CPU).

Each compiled way of training (GRAPH_MODE with a `TrainOneStepCell`, `Model.train` with and
without dataset sink mode, a `mindspore.jit` train step in PyNative mode) is run on the same
net, weights and batches as a PyNative `value_and_grad` loop, and every watched Cell's output,
input and output-gradient statistics must equal PyNative's (float32 reductions in another
order: rtol 1e-5; counts and numel exact); the losses must be bitwise those of the same compiled
run without the monitor.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mindspore as ms  # noqa: E402
import mindspore.dataset as ds  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mindspore import Parameter, Tensor, nn, ops  # noqa: E402
from mindspore.train import Model  # noqa: E402

from msprobe_engine.frameworks.mindspore import kernel_op  # noqa: E402
from msprobe_engine.frameworks.mindspore.graph_capture import GraphCapture  # noqa: E402
from msprobe_engine.frameworks.mindspore.backend import Difference, partial_stats, plan_rows, stat_rows  # noqa: E402
from msprobe_engine.dump import iter_dump_tensors, load_dump  # noqa: E402
from msprobe_engine.incident.actions import TrainingStopped  # noqa: E402
from msprobe_integrations.mindspore import FiniteGate, MindSporeMonitor, MonitorCallback  # noqa: E402

ms.set_device("CPU")

STATS = ["min", "max", "mean", "norm", "nan_count", "inf_count"]
WATCH = {"module_outputs": True, "module_inputs": True, "activation_grads": True, "param_grads": True,
         "params": True, "optimizer_state": ["exp_avg", "exp_avg_sq"]}
STEPS = 3


class Poison(nn.Cell):
    """Multiplies by `scale` (a Parameter, so a compiled graph reads it at run time): nan poisons."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = Parameter(Tensor(1.0, ms.float32), name="poison_scale", requires_grad=False)

    def construct(self, x):
        return x * self.scale

    def set(self, poisoned: bool) -> None:
        ops.assign(self.scale, Tensor(float("nan") if poisoned else 1.0, ms.float32))  # set_data: jit keeps the old


class Halves(nn.Cell):
    """A Cell with a tuple output."""

    def construct(self, x):
        return x[:, :4], x[:, 4:] * 2.0


class SqrtSquare(nn.Cell):
    """sqrt(x * x): finite forward; where x is 0 its input gradient is nan (0 * inf)."""

    def construct(self, x):
        return ops.sqrt(x * x)


class Net(nn.Cell):
    def __init__(self, sqrt: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Dense(6, 8)
        self.act = nn.Tanh()
        self.halves = Halves()
        self.poison = Poison()
        self.fc2 = nn.Dense(8, 3)
        self.relu = nn.ReLU() if sqrt else None  # zeros, where SqrtSquare's input gradient is nan
        self.sqrt = SqrtSquare() if sqrt else None

    def construct(self, x):
        a, b = self.halves(self.act(self.fc1(x)))
        h = self.poison(ops.cat([a, b], 1))
        if self.sqrt is not None:
            h = self.sqrt(self.relu(h))
        return self.fc2(h)


def make(sqrt: bool = False):
    ms.set_seed(0)
    net = Net(sqrt)
    return net, nn.Adam(net.trainable_params(), learning_rate=0.01)


def batches(n: int = STEPS):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32))
            for _ in range(n)]


def config(tmp_path, **extra):
    return {"output_dir": str(tmp_path), "strict": True, "sinks": ["jsonl"], "stats": STATS, "watch": WATCH,
            **extra}


def grad_fn_of(net, opt):
    loss_fn = nn.MSELoss()

    def forward(x, y):
        return loss_fn(net(x), y)

    return ms.value_and_grad(forward, None, opt.parameters)


def train(how: str, tmp_path=None, poison_step: int = -1, sqrt: bool = False, replayed: bool = False, **extra):
    """Train STEPS steps `how`; returns (losses as bytes, the monitor's records or None).
    `replayed`: each step (its step end inside) runs through `run_step`, so an incident replays it."""
    ms.set_context(mode=ms.PYNATIVE_MODE if how in ("pynative", "jit") else ms.GRAPH_MODE)
    try:
        net, opt = make(sqrt)
        if how.startswith("model"):
            return _model_train(net, opt, how == "model-sink", tmp_path, poison_step, extra)
        monitor = MindSporeMonitor(net, opt, config(tmp_path, **extra)) if tmp_path is not None else None
        losses = []
        if how in ("pynative", "jit"):
            grad_fn = grad_fn_of(net, opt)

            def step(x, y):
                loss, grads = grad_fn(x, y)
                opt(grads)
                return loss, grads
            if how == "jit":
                step = ms.jit(step)
        else:
            step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt, return_grad=True)
        if replayed and monitor is not None:
            step = replayable_step(monitor, step)
        for i, (x, y) in enumerate(batches()):
            net.poison.set(i == poison_step)
            loss, grads = step(Tensor(x), Tensor(y))
            if monitor is not None and not replayed:
                monitor.step_end(loss, grads)
            losses.append(loss.asnumpy().tobytes())
        if monitor is None:
            return losses, None
        monitor.close()
        return losses, list(monitor.monitor.history)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def replayable_step(monitor, train_step):
    """`train_step` and the step end (where a compiled step is decided) through `run_step`."""
    @monitor.replayable
    def step(x, y):
        loss, grads = train_step(x, y)
        monitor.step_end(loss, grads)
        return loss, grads
    return step


def _model_train(net, opt, sink, tmp_path, poison_step, extra):
    losses = []

    class Watch(ms.train.Callback):
        def on_train_step_begin(self, run_context):
            net.poison.set(len(losses) == poison_step)

        def on_train_step_end(self, run_context):
            losses.append(run_context.original_args().net_outputs[0].asnumpy().tobytes())

    callbacks = [Watch()]
    callback = None
    if tmp_path is not None:
        callback = MonitorCallback(net, opt, config=config(tmp_path, **extra))
        callbacks.append(callback)
    train_net = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt, return_grad=True)
    dataset = ds.GeneratorDataset(lambda: iter(batches()), ["x", "y"], shuffle=False)
    Model(train_net).train(1, dataset, callbacks=callbacks, dataset_sink_mode=sink)
    return losses, (list(callback.monitor.monitor.history) if callback is not None else None)


def activation_metrics(record) -> dict[str, float]:
    return {k: v for k, v in record.metrics.items() if k.startswith(("actv/", "actv_grad/"))}


def tensor_metrics(record) -> dict[str, float]:
    """The activations', gradients', parameters' and optimizer state's metrics (in a compiled step all
    measured inside its graph)."""
    return {k: v for k, v in record.metrics.items() if k.startswith(("actv/", "actv_grad/", "grad/", "param/",
                                                                     "optim/"))}


def assert_same_activations(got, want) -> None:
    assert sorted(got) == sorted(want)
    for tag, value in want.items():
        if tag.endswith(("nan_count", "inf_count")):
            assert got[tag] == value, tag
        else:
            np.testing.assert_allclose(got[tag], value, rtol=1e-5, atol=1e-7, err_msg=tag)


@pytest.fixture(scope="module")
def pynative(tmp_path_factory):
    return train("pynative", tmp_path_factory.mktemp("pynative"))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["graph", "model-sink"])
def test_compiled_activation_statistics_equal_pynative_and_losses_are_unchanged(tmp_path, pynative, how):
    """`model-sink`: Model.train with dataset sink mode, against the run without the monitor and
    without sink mode (which MindSpore's CPU backend does not honour: the same graph). The jit
    train step: the fast lane's test below."""
    assert_compiled_run_equals_pynative(how, tmp_path, pynative)


def assert_compiled_run_equals_pynative(how: str, tmp_path, pynative) -> None:
    """Every step's activation statistics of a run trained `how` equal PyNative's; its losses are
    bitwise those of the same compiled run without the monitor."""
    losses, history = train(how, tmp_path / "on")
    reference_losses, reference = pynative
    assert [r.step for r in history] == list(range(STEPS))
    for record, want in zip(history, reference):
        got = activation_metrics(record)
        assert "actv/halves/output.1/norm" in got and "actv_grad/fc1/output/norm" in got
        assert "actv/fc2/input.0/max" in got
        assert_same_activations(got, activation_metrics(want))
        got = tensor_metrics(record)
        assert "grad/fc1.weight/norm" in got and "optim/fc2.bias/exp_avg_sq/max" in got
        assert_same_activations(got, tensor_metrics(want))
    without, _ = train("model" if how == "model-sink" else how)
    assert losses == without  # bitwise: the taps change no value the step computes


@pytest.mark.parametrize("reductions", ["kernel", "mindspore"])
def test_a_jit_train_step_measures_activations_as_pynative_and_leaves_the_losses_unchanged(tmp_path, pynative, capfd,
                                                                                           monkeypatch, reductions):
    """The fast lane's check of the in-graph capture (a `mindspore.jit` train step), measured by the
    C kernel's operators (on CPU, where built) and by MindSpore's reductions (elsewhere). The taps'
    graph compiles and runs without MindSpore's KERNEL warnings (its C++ log goes to fd 2)."""
    asked = []
    usable = kernel_op.usable if reductions == "kernel" else (lambda *args, **kwargs: False)
    monkeypatch.setattr(kernel_op, "usable", lambda *args, **kwargs: asked.append(usable(*args, **kwargs)) or asked[-1])
    assert_compiled_run_equals_pynative("jit", tmp_path, pynative)
    assert len(asked) >= 2 and all(asked) == (reductions == "kernel")  # the Cells' taps and the optimizer's
    err = capfd.readouterr().err
    assert "KERNEL" not in err and "For 'Cast'" not in err, err[-2000:]


def test_unmonitored_steps_of_a_compiled_step_leave_the_statistics_untouched_and_launch_no_reset(tmp_path, monkeypatch):
    """`schedule.interval: 2`: steps 0 and 2 are measured and equal PyNative's same steps; on step 1
    the kernel's operators read no tensor and write nothing, so its step end launches no reset of
    the statistics Parameter (two resets in all: after steps 0 and 2)."""
    schedule = {"start_step": 0, "interval": 2}
    _, want = train("pynative", tmp_path / "pynative", schedule=schedule)
    resets = []
    clear = GraphCapture._clear
    monkeypatch.setattr(GraphCapture, "_clear", lambda capture: resets.append(capture) or clear(capture))
    losses, got = train("jit", tmp_path / "jit", schedule=schedule)
    assert [r.step for r in got] == [r.step for r in want] == [0, 2]
    for record, reference in zip(got, want):
        assert_same_activations(activation_metrics(record), activation_metrics(reference))
    assert len(resets) == 2
    assert losses == train("jit")[0]


def incident_of(tmp_path, step: int) -> tuple[dict, object]:
    """incident.json of the non_finite incident of `step`, and its directory."""
    directory, = tmp_path.rglob(f"incidents/step{step}-rank0-non_finite")
    return json.loads((directory / "incident.json").read_text()), directory


@pytest.mark.slow
@pytest.mark.parametrize("how", ["graph", "jit"])
def test_a_nan_made_in_the_graph_is_named_at_its_cell_and_the_step_replayed_in_pynative(tmp_path, how):
    losses, history = train(how, tmp_path, poison_step=1, replayed=True,
                            alerts=[{"rule": "non_finite", "action": "continue"}])
    records = {r.step: r for r in history}
    assert not records[0].alerts
    starts = [a for a in records[1].alerts if a.phase == "start"]
    assert (starts[0].rule, starts[0].tag) == ("non_finite", "actv/poison/output/nan_count")
    assert records[1].metrics["actv/halves/output.0/nan_count"] == 0  # the Cell before it was fine
    assert records[1].metrics["actv/poison/output/nan_count"] == 40
    incident, directory = incident_of(tmp_path, 1)
    assert (incident["culprit"]["call"], incident["culprit"]["dump_entry"]) == ("poison", "Cell.poison.Poison.forward.0")
    replay = incident["replay"]
    # run again eagerly from the step's own weights (restored): the same values, bitwise
    assert replay["status"] == "reproducible" and all(check["identical"] for check in replay["checks"])
    dump = load_dump(directory / replay["dump"])[(1, None)]
    assert (dump.task, dump.meta["level"], dump.meta["framework"]) == ("tensor", "L0", "mindspore")
    entry = dump.data["Cell.poison.Poison.forward.0"]
    output, = [ref for ref in iter_dump_tensors({"data": {"e": entry}}) if ref.role == "output"]
    assert np.isnan(dump.load_tensor(output)).sum() == 40
    assert "Cell.fc1.Dense.backward.0" in dump.data
    if how == "graph":  # the replay left no trace (weights, moments, counters)
        assert losses == train(how, poison_step=1)[0]


@pytest.mark.slow
def test_a_nan_made_in_the_backward_pass_is_named_as_pynative_names_it(tmp_path):
    alerts = [{"rule": "non_finite", "action": "continue"}]
    named = {}
    for how in ("pynative", "graph"):
        _, history = train(how, tmp_path / how, sqrt=True, alerts=alerts, replayed=how == "graph")
        starts = [a for a in history[0].alerts if a.phase == "start"]
        named[how] = starts[0].tag
        forward = {k: v for k, v in history[0].metrics.items() if k.startswith("actv/") and k.endswith("_count")}
        assert not any(forward.values())  # the forward pass is finite
        assert all(np.isfinite(v) for k, v in history[0].metrics.items() if k.startswith("grad/"))
    assert named["graph"] == named["pynative"] == "actv_grad/relu/output/nan_count"
    # the replay in PyNative sees which Cell read relu's output: the one whose backward made the nan
    culprit = incident_of(tmp_path / "graph", 0)[0]["culprit"]
    assert (culprit["call"], culprit["phase"], culprit["from"]) == ("sqrt", "backward", "replay")


def l0_dump(how: str, path) -> None:
    """An L0 statistics dump of two steps trained `how` (graph: taken inside the compiled graph)."""
    from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger

    ms.set_context(mode=ms.GRAPH_MODE if how == "graph" else ms.PYNATIVE_MODE)
    try:
        net, opt = make()
        debugger = MindSporePrecisionDebugger({"task": "statistics", "dump_path": str(path), "level": "L0",
                                               "strict": True})
        train_net = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt, return_grad=True)
        for x, y in batches(2):
            debugger.start(net)
            _, grads = train_net(Tensor(x), Tensor(y))
            debugger.stop()
            debugger.step(grads)
        debugger.close()
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.mark.slow
def test_a_graph_mode_l0_dump_is_paired_with_a_pynative_one_by_the_predecessors_compare(tmp_path):
    from tests.test_mindspore_predecessor import _their_compare

    for how in ("graph", "pynative"):
        l0_dump(how, tmp_path / how)
    table = _their_compare(tmp_path / "graph" / "step1", tmp_path / "pynative" / "step1", tmp_path / "compare")
    names = set(table["NPU Name"])
    assert {"Cell.halves.Halves.forward.0.output.1", "Cell.fc2.Dense.forward.0.input.0",
            "Cell.act.Tanh.backward.0.input.0", "Cell.fc1.Dense.parameters_grad.0.weight"} <= names
    assert len(table) >= 21 and (table["NPU Name"] == table["Bench Name"]).all()  # every entry paired
    assert set(table["Result"]) == {"pass"}
    errors = table["NormRelativeErr"].astype(str).str.rstrip("%").astype(float)
    assert (errors < 1e-3).all()  # in percent


def optimizer_values(opt) -> dict[str, np.ndarray]:
    return {name: p.asnumpy().copy() for name, p in opt.parameters_and_names()}


@pytest.mark.slow
def test_finite_gate_skips_a_non_finite_step_inside_the_graph_and_stop_stops_at_the_step_end(tmp_path):
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        net, opt = make()
        gate = FiniteGate(opt)
        train_net = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), gate, return_grad=True)
        monitor = MindSporeMonitor(net, opt, config(tmp_path / "skip", alerts=[{"rule": "non_finite",
                                                                                "action": "skip"}]))
        changed = []
        for i, (x, y) in enumerate(batches()):
            net.poison.set(i == 1)
            before = optimizer_values(opt)
            loss, grads = train_net(Tensor(x), Tensor(y))
            monitor.step_end(loss, grads)
            after = optimizer_values(opt)
            changed.append(not all(np.array_equal(before[n], after[n]) for n in before))
        monitor.close()
        assert changed == [True, False, True]  # weights, moments, global_step, beta powers: bitwise kept
        assert int(gate.skipped.asnumpy()) == 1
        assert all(np.isfinite(p.asnumpy()).all() for p in opt.parameters)
        starts = [a for a in monitor.monitor.history[1].alerts if a.phase == "start"]
        assert starts[0].tag == "actv/poison/output/nan_count"

        net, opt = make()
        train_net = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt, return_grad=True)
        monitor = MindSporeMonitor(net, opt, config(tmp_path / "stop", alerts=[{"rule": "non_finite",
                                                                                "action": "stop"}]))
        stopped = None
        for i, (x, y) in enumerate(batches()):
            net.poison.set(i == 1)
            loss, grads = train_net(Tensor(x), Tensor(y))
            try:
                monitor.step_end(loss, grads)
            except TrainingStopped as stop:
                stopped = (i, stop.step, stop.rules)
                break
        monitor.close()
        assert stopped == (1, 1, ["non_finite"])
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


# ---- a model ported from a transformers config ------------------------------------------------

class Attention(nn.Cell):
    """GPT-2's causal self-attention (fused qkv projection), no dropout."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.heads, self.width = cfg.n_head, cfg.n_embd
        self.c_attn = nn.Dense(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Dense(cfg.n_embd, cfg.n_embd)
        self.softmax = nn.Softmax(-1)

    def construct(self, x, mask=None):
        batch, seq, width = x.shape
        head = width // self.heads
        q, k, v = ops.split(self.c_attn(x), width, 2)
        q, k, v = (t.reshape(batch, seq, self.heads, head).transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) / float(np.sqrt(head))
        if mask is not None:
            scores = scores + mask
        out = ops.matmul(self.softmax(scores), v).transpose(0, 2, 1, 3).reshape(batch, seq, width)
        return self.c_proj(out)


class Block(nn.Cell):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm((cfg.n_embd,), epsilon=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm((cfg.n_embd,), epsilon=cfg.layer_norm_epsilon)
        self.mlp = nn.SequentialCell(nn.Dense(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(approximate=True),
                                     nn.Dense(4 * cfg.n_embd, cfg.n_embd))

    def construct(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask=mask)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Cell):
    """GPT-2 built from a `transformers.GPT2Config` (its sizes; random weights, no download)."""

    def __init__(self, cfg, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.CellList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm((cfg.n_embd,), epsilon=cfg.layer_norm_epsilon)
        self.lm_head = nn.Dense(cfg.n_embd, cfg.vocab_size, has_bias=False)
        self.positions = Tensor(np.arange(seq, dtype=np.int32))
        self.mask = Tensor(np.triu(np.full((seq, seq), -1e9, np.float32), 1))

    def construct(self, ids):
        x = self.wte(ids) + self.wpe(self.positions)
        for block in self.h:
            x = block(x, self.mask)
        return self.lm_head(self.ln_f(x))


class LMLoss(nn.Cell):
    def __init__(self, net, vocab: int) -> None:
        super().__init__(auto_prefix=False)
        self.net, self.vocab = net, vocab
        self.loss = nn.CrossEntropyLoss()

    def construct(self, ids, labels):
        return self.loss(self.net(ids).reshape(-1, self.vocab), labels.reshape(-1))


def train_gpt2(how: str, tmp_path=None):
    from transformers import GPT2Config
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    ms.set_context(mode=ms.PYNATIVE_MODE if how == "pynative" else ms.GRAPH_MODE)
    try:
        ms.set_seed(0)
        net = GPT2(cfg, seq=8)
        opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3)
        monitor = MindSporeMonitor(net, opt, config(tmp_path)) if tmp_path is not None else None
        train_net = nn.TrainOneStepCell(LMLoss(net, cfg.vocab_size), opt, return_grad=True)
        rng = np.random.default_rng(0)
        losses, records = [], []
        for _ in range(2):
            ids = rng.integers(0, cfg.vocab_size, (4, 9)).astype(np.int32)
            loss, grads = train_net(Tensor(ids[:, :-1]), Tensor(ids[:, 1:]))
            if monitor is not None:
                records.append(monitor.step_end(loss, grads))
            losses.append(loss.asnumpy().tobytes())
        if monitor is not None:
            monitor.close()
        return losses, list(monitor.monitor.history) if monitor is not None else None
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.mark.slow
def test_a_gpt2_ported_from_a_transformers_config_measures_as_in_pynative(tmp_path):
    _, reference = train_gpt2("pynative", tmp_path / "pynative")
    losses, history = train_gpt2("graph", tmp_path / "graph")
    for record, want in zip(history, reference):
        got = activation_metrics(record)
        for tag in ("actv/h.0.attn/output/norm", "actv/h.0.mlp.1/output/max", "actv/wte/input.0/max",
                    "actv_grad/h.0.ln_1/output/norm", "actv/h.0.attn.softmax/output/min"):
            assert tag in got, tag
        want = activation_metrics(want)
        keyword = {tag for tag in want if "/input.mask/" in tag}  # keyword inputs: PyNative only
        assert keyword and not keyword & set(got)
        assert_same_activations(got, {tag: v for tag, v in want.items() if tag not in keyword})
    assert losses == train_gpt2("graph")[0]


class _PackedRows(nn.Cell):
    """`stat_rows` of a plan with a pack, compiled as a graph tap compiles it."""

    def __init__(self, plan, count_zeros: bool) -> None:
        super().__init__()
        self.plan, self.count_zeros = plan, count_zeros

    @ms.jit
    def construct(self, tensors):
        plan = self.plan
        return stat_rows(tensors, plan.layout, plan.differences, plan.empty, plan.gather, self.count_zeros, plan.pack)


def test_packed_rows_of_a_graph_tap_equal_the_per_group_rows():
    """The graph taps' packed reduction (small tensors, an update, a float64 one and a large one
    beside them) gives `partial_stats`' rows, finite and with a nan and an inf (one compile):
    min/max exact, sums within float32 reordering, nan/inf/zero counts and numel exact, a nan's
    min and max nan, the other tensors' rows untouched by it."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in [(3, 700), (10,), (5000,), (40, 40)]]
    arrays[1][:4] = 0.0
    finite = [Tensor(a) for a in arrays] + [Tensor(rng.standard_normal(70000).astype(np.float32)),
                                            Tensor(rng.standard_normal(9))]
    arrays[2][[7, 4099]] = [np.nan, np.inf]
    poisoned = [*finite[:2], Tensor(arrays[2]), *finite[3:]]
    half = Tensor(arrays[3] * 0.5)
    compiled = None
    for tensors in (finite, poisoned):
        items = tensors + [Difference(tensors[3], half)]
        plan = plan_rows(items, range(len(items)), packed=True)
        assert plan.pack is not None and plan.pack.members == 5  # the four small float32 ones and the update
        compiled = compiled or _PackedRows(plan, True)
        flat = tuple(t for i in plan.order for t in (items[i] if isinstance(items[i], Difference) else (items[i],)))
        got = compiled(flat).asnumpy()
        want = partial_stats(items, True).asnumpy()
        np.testing.assert_array_equal(got[:, [0, 1, 4, 5, 6, 7]], want[:, [0, 1, 4, 5, 6, 7]])
        np.testing.assert_allclose(got[:, 2:4], want[:, 2:4], rtol=1e-5, atol=1e-5)
        nan = tensors is poisoned
        assert np.isnan(got[2, 0]) == nan and got[2, 4:6].tolist() == ([1, 1] if nan else [0, 0])
        assert got[1, 6] == 4 and np.isfinite(got[[0, 1, 3, 4, 5, 6], 2]).all()


class Counting(nn.Cell):
    """Counts its calls in a Parameter assigned in its own `construct`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = Parameter(Tensor(0.0, ms.float32), name="calls", requires_grad=False)
        self.dense = nn.Dense(6, 3)

    def construct(self, x):
        self.calls = self.calls + 1
        return self.dense(x)


def test_a_watched_cell_assigning_its_own_parameter_in_construct_keeps_the_assignment_when_compiled(tmp_path):
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        ms.set_seed(0)
        counting = Counting()
        net = nn.SequentialCell(counting, nn.Tanh())
        opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
        monitor = MindSporeMonitor(net, opt, config(tmp_path))
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt, return_grad=True)
        for x, y in batches(2):
            loss, grads = step(Tensor(x), Tensor(y))
            monitor.step_end(loss, grads)
        monitor.close()
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert float(counting.calls.asnumpy()) == 2
    assert type(counting) is Counting  # the tap was removed
