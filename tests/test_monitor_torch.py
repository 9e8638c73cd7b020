"""The monitor on plain PyTorch: what it measures, when, and that it changes nothing."""
import json
import logging

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from examples.tiny_gpt import TinyGPT, inject, synthetic_batches
from msprobe_engine import Monitor
from msprobe_engine.stats import finalize, reference_partial
from msprobe_integrations.torch import TorchMonitor

EVERYTHING = {"strict": True, "sinks": ["jsonl"],
              "watch": {"module_outputs": True, "module_inputs": True, "activation_grads": True,
                        "param_grads": True, "params": True,
                        "optimizer_state": ["exp_avg", "exp_avg_sq", "update", "ratio"]}}


def config(tmp_path, **overrides):
    return {**EVERYTHING, "output_dir": str(tmp_path), **overrides}


def train(model, optimizer, steps, monitor=None, accumulate=1, seed=0, before_step=None):
    losses = []
    batches = synthetic_batches(model.cfg, steps * accumulate, seed=seed)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            tokens, targets = next(batches)
            loss = model(tokens, targets) / accumulate
            loss.backward()
        if before_step is not None:
            before_step()
        optimizer.step()
        if monitor is not None:
            monitor.step_end(loss)
        losses.append(loss.detach().clone())
    return torch.stack(losses)


def gpt_and_adam(seed=0):
    torch.manual_seed(seed)
    model = TinyGPT()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_losses_are_bitwise_identical_with_the_monitor(tmp_path):
    model, opt = gpt_and_adam()
    plain = train(model, opt, 20)
    model, opt = gpt_and_adam()
    monitor = TorchMonitor(model, opt, config(tmp_path))
    watched = train(model, opt, 20, monitor)
    monitor.close()
    assert torch.equal(plain, watched)
    assert monitor.records_written == 20


def test_one_transfer_per_monitored_step_and_none_otherwise(tmp_path):
    model, opt = gpt_and_adam()
    monitor = TorchMonitor(model, opt, config(tmp_path, schedule={"start_step": 2, "interval": 3}))
    counts = []
    for _ in range(9):
        train(model, opt, 1, monitor)
        counts.append(monitor.transfers)
    monitor.close()
    # monitored steps: 2, 5, 8
    assert counts == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert [r.step for r in monitor.history] == [2, 5, 8]


def test_gradients_are_read_once_per_optimizer_step_at_the_accumulation_boundary(tmp_path):
    model, opt = gpt_and_adam()
    monitor = TorchMonitor(model, opt, config(tmp_path))
    seen = {}
    opt.register_step_pre_hook(lambda o, a, k: seen.update(
        {n: reference_partial(p.grad.numpy()) for n, p in model.named_parameters()}))
    train(model, opt, 2, monitor, accumulate=2)
    monitor.close()
    record = monitor.history[-1]
    assert record.micro_steps == 2
    for name, ref in seen.items():
        want = finalize(ref)
        np.testing.assert_allclose(record.metrics[f"grad/{name}/norm"], want["norm"], rtol=1e-5)
        np.testing.assert_allclose(record.metrics[f"grad/{name}/max"], want["max"], rtol=1e-6)
    global_norm = np.sqrt(sum(finalize(r)["norm"] ** 2 for r in seen.values()))
    np.testing.assert_allclose(record.metrics["grad/global/norm"], global_norm, rtol=1e-5)


def test_activations_merge_over_micro_steps_and_optimizer_state_matches(tmp_path):
    model, opt = gpt_and_adam()
    monitor = TorchMonitor(model, opt, config(tmp_path))
    outputs = []
    handle = model.head.register_forward_hook(lambda m, a, out: outputs.append(out.detach().clone()))
    train(model, opt, 1, monitor, accumulate=2)
    handle.remove()
    monitor.close()
    metrics = monitor.history[-1].metrics
    both = torch.cat(outputs).numpy()
    np.testing.assert_allclose(metrics["actv/head/output/norm"], np.linalg.norm(both.astype(np.float64)), rtol=1e-5)
    assert metrics["actv/head/output/max"] == both.max()
    state = opt.state[model.head.weight]
    np.testing.assert_allclose(metrics["optim/head.weight/exp_avg_sq/norm"],
                               state["exp_avg_sq"].double().norm().item(), rtol=1e-5)
    np.testing.assert_allclose(metrics["param/head.weight/norm"], model.head.weight.double().norm().item(), rtol=1e-5)
    assert 0 < metrics["optim/head.weight/ratio"] < 0.1


class Odd(nn.Module):
    """Outputs of every awkward shape, and a submodule called three times."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        h = self.act(self.lin(x))
        h = self.act(h) + self.act(-h)
        return {"value": h, "nothing": None, "meta": "text", "pair": (h.sum(), 3)}


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.odd = Odd()
        self.none_out = NoneOut()

    def forward(self, x):
        self.none_out(x)
        return self.odd(x)["value"].pow(2).mean()


class NoneOut(nn.Module):
    def forward(self, x):
        return None


def test_unusual_outputs_are_skipped_and_repeated_calls_are_numbered(tmp_path):
    model = Wrapper()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TorchMonitor(model, opt, config(tmp_path, sinks=[]))
    loss = model(torch.randn(2, 4))
    loss.backward()
    opt.step()
    monitor.step_end(loss)
    monitor.close()
    metrics = monitor.history[-1].metrics
    actv = sorted({t.rsplit("/", 1)[0] for t in metrics if t.startswith("actv/")})
    assert "actv/odd/output.value" in actv and "actv/odd/output.pair.0" in actv
    assert {"actv/odd.act/output", "actv/odd.act:1/output", "actv/odd.act:2/output"} <= set(actv)
    assert not any("nothing" in t or "meta" in t or "none_out/output" in t for t in metrics)
    assert "actv/none_out/input.0/norm" in metrics  # inputs on request
    assert all(v == 0 for t, v in metrics.items() if t.endswith("nan_count"))
    assert monitor.alert_log.maxlen and not monitor.alert_log


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.use_reentrant = use_reentrant

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=self.use_reentrant).sum()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_is_not_counted_twice(tmp_path, use_reentrant):
    model = Checkpointed(use_reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TorchMonitor(model, opt, config(tmp_path, sinks=[], stats=["numel", "norm"]))
    x = torch.randn(3, 8, requires_grad=use_reentrant)
    loss = model(x)
    loss.backward()
    opt.step()
    monitor.step_end(loss)
    monitor.close()
    metrics = monitor.history[-1].metrics
    assert metrics["actv/block.1/output/numel"] == 24  # one call's worth, not two
    assert metrics["actv_grad/block.1/output/numel"] == 24
    np.testing.assert_allclose(metrics["actv_grad/block.1/output/norm"], np.sqrt(24), rtol=1e-6)


def test_non_finite_alert_starts_and_ends_once_and_names_the_layer(tmp_path, caplog):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = None
    inject(model, "layers.1.mlp.0", lambda: monitor.step, 4, "nan")
    monitor = TorchMonitor(model, opt, config(tmp_path, sinks=["jsonl", "tensorboard"]))
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        train(model, opt, 8, monitor, before_step=lambda: [p.grad.nan_to_num_(0.0) for p in model.parameters()])
    monitor.close()  # (the nan gradients were zeroed: the nan does not persist in the weights)
    events = [(e.rule, e.phase, e.step) for e in monitor.alert_log]
    assert events == [("non_finite", "start", 4), ("non_finite", "end", 5)]
    assert monitor.alert_log[0].tag == "actv/layers.1.mlp.0/output/nan_count"
    assert monitor.alert_log[1].steps == 1
    assert sum("non_finite start" in r.message for r in caplog.records) == 1
    lines = [json.loads(l) for l in (tmp_path / "rank0" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == list(range(8))
    assert lines[4]["alerts"][0]["tag"] == "actv/layers.1.mlp.0/output/nan_count"
    assert np.isnan(lines[4]["metrics"]["train/loss"])


def test_spike_rule_fires_after_warmup_and_reports_episodes(tmp_path):
    monitor = Monitor(config(tmp_path, sinks=[], alerts=[{"rule": "spike", "factor": 3.0, "warmup": 3}]))
    losses = [1.0, 1.1, 0.9, 1.0, 50.0, 60.0, 1.0, 1.0]
    for loss in losses:
        monitor.step_end(torch.tensor(loss))
    monitor.close()
    events = [(e.rule, e.phase, e.step, e.tag) for e in monitor.alert_log]
    assert events == [("spike", "start", 4, "train/loss"), ("spike", "end", 6, "train/loss")]
    average = 1.0
    for value in losses[1:4]:
        average = 0.9 * average + 0.1 * value  # the exponential running average before the spike
    assert monitor.alert_log[0].threshold == pytest.approx(3.0 * average)


class Exploding(nn.Module):
    def forward(self, x):
        raise_in_hook = x.sum()
        return raise_in_hook


def test_a_hook_error_is_reported_once_and_training_goes_on(tmp_path, caplog):
    model, opt = gpt_and_adam()
    monitor = TorchMonitor(model, opt, config(tmp_path, strict=False, sinks=[]))
    monitor.monitor.backend = BrokenBackend(monitor.monitor.backend)
    with caplog.at_level(logging.ERROR, logger="msprobe_engine"):
        losses = train(model, opt, 3, monitor)
    monitor.close()
    assert torch.isfinite(losses).all()
    errors = [r for r in caplog.records if "forward hook of layers.0.ln1" in r.message]
    assert len(errors) == 1 and "boom" in errors[0].message
    assert monitor.hook_errors["forward hook of layers.0.ln1"] == 1  # then disabled
    assert "actv/layers.0.ln1/output/norm" not in monitor.history[-1].metrics
    assert "actv/layers.0.ln2/output/norm" in monitor.history[-1].metrics


def test_strict_mode_re_raises_hook_errors(tmp_path):
    model, opt = gpt_and_adam()
    monitor = TorchMonitor(model, opt, config(tmp_path, sinks=[]))
    monitor.monitor.backend = BrokenBackend(monitor.monitor.backend)
    with pytest.raises(RuntimeError, match="boom"):
        train(model, opt, 1, monitor)


class BrokenBackend:
    """The real torch backend, except that it fails on LayerNorm outputs of layer 0."""

    def __init__(self, real):
        self.real = real
        self.calls = 0

    def partial_stats(self, tensors, **options):
        import inspect
        frame = inspect.currentframe().f_back.f_back
        if "layers.0.ln1" in str(frame.f_locals.get("name", "")):
            raise RuntimeError("boom")
        return self.real.partial_stats(tensors, **options)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        TorchMonitor("model")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got dict"):
        TorchMonitor(nn.Linear(2, 2), {"lr": 1})


def test_update_statistics_are_those_of_the_parameter_change_step_after_step(tmp_path):
    """`update` is after - before exactly (the CPU path keeps a copy between steps and the C kernel
    reduces the difference without writing it): every step's min and max the reference's bit for
    bit, the norm within 1e-6; a parameter that did not move has an update of +0.0, not -0.0."""
    model, opt = gpt_and_adam()
    monitor = TorchMonitor(model, opt, config(tmp_path, sinks=[], stats=["min", "max", "norm"]))
    want = []
    for step in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        train(model, opt, 1, monitor, seed=step)
        want.append({n: finalize(reference_partial((p.detach() - before[n]).numpy()))
                     for n, p in model.named_parameters()})
    monitor.close()
    for step, (record, ref) in enumerate(zip(monitor.history, want)):
        for name, stats in ref.items():
            for stat in ("min", "max"):
                got = np.float64(record.metrics[f"optim/{name}/update/{stat}"])
                assert got.tobytes() == np.float64(stats[stat]).tobytes(), (step, name, stat)
            np.testing.assert_allclose(record.metrics[f"optim/{name}/update/norm"], stats["norm"], rtol=1e-6)

    still = nn.Linear(4, 4)
    opt = torch.optim.SGD(still.parameters(), lr=0.1)  # no momentum: a zero gradient moves nothing
    monitor = TorchMonitor(still, opt, config(tmp_path / "still", sinks=[], stats=["min", "max"]))
    for _ in range(2):
        opt.zero_grad()
        (still(torch.ones(2, 4)) * 0).sum().backward()
        opt.step()
        monitor.step_end()
    monitor.close()
    for record in monitor.history:
        for stat in ("min", "max"):
            assert np.float64(record.metrics[f"optim/weight/update/{stat}"]).tobytes() == np.float64(0.0).tobytes()
