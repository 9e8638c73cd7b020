"""Replay of an anomalous step run through `Monitor.run_step`: reproducible or transient, a tensor
dump of the step, and no trace in the training (RNG, gradients, buffers, optimizer step)."""
import pytest
import torch
from torch import nn

from examples.tiny_gpt import inject
from incident_helpers import config, gpt_and_adam, inject_backward, read_incident, run
from msprobe_engine.dump import iter_dump_tensors, load_dump
from msprobe_integrations.torch import TorchMonitor

INCIDENT = "incidents/step3-rank0-non_finite"


class Counting(nn.Module):
    """A buffer that changes in the forward, as BatchNorm's running statistics do."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x


def train_with_dropout(tmp_path, replay: bool):
    model, opt = gpt_and_adam()
    model.layers[0].mlp.append(nn.Dropout(0.2))
    model.layers[0].mlp.append(Counting())
    monitor = None
    inject_backward(model, "layers.0.mlp.0", lambda: monitor.step, 3)
    monitor = TorchMonitor(model, opt, config(tmp_path, incidents={"replay": {"enabled": replay}}))
    head_grads = []
    losses = run(model, opt, monitor, 6, on_step=lambda: head_grads.append(model.head.weight.grad.norm().item()))
    monitor.close()
    return torch.stack(losses), model, opt, head_grads


def test_a_replay_reproduces_the_step_and_leaves_no_trace(tmp_path):
    losses, model, opt, head_grads = train_with_dropout(tmp_path / "a", replay=True)
    plain_losses, plain, plain_opt, plain_grads = train_with_dropout(tmp_path / "b", replay=False)
    replay = read_incident(tmp_path / "a" / INCIDENT)["replay"]
    assert replay["status"] == "reproducible"
    assert all(check["reproduced"] and check["identical"] for check in replay["checks"])  # RNG restored
    # the replay's backward started from no gradient (not accumulated on the step's own)
    assert head_grads == plain_grads[:4] + plain_grads[3:4] + plain_grads[4:]
    # and the run went on exactly as without it: no optimizer step, RNG, buffers, gradients
    assert torch.equal(losses, plain_losses)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
        assert all(torch.equal(v, plain_opt.state[q][k]) for k, v in opt.state[p].items())
    assert model.layers[0].mlp[4].calls == plain.layers[0].mlp[4].calls == 6
    assert read_incident(tmp_path / "b" / INCIDENT)["replay"]["status"] == "not_run"


@pytest.mark.parametrize("level", ["L0", "mix"])
def test_the_replay_dumps_the_tensors_of_the_step(tmp_path, level):
    model, opt = gpt_and_adam()
    monitor = None
    inject(model, "layers.1.mlp.0", lambda: monitor.step, 3, "nan")
    monitor = TorchMonitor(model, opt, config(tmp_path, incidents={"replay": {"level": level}}))
    run(model, opt, monitor, 4)
    monitor.close()
    incident = read_incident(tmp_path / INCIDENT)
    assert incident["replay"]["dump"] == "replay"
    dumps = load_dump(tmp_path / INCIDENT / "replay")
    dump = dumps[(3, None)]
    assert (dump.task, dump.meta["level"]) == ("tensor", level)
    entry = incident["culprit"]["dump_entry"]
    outputs = [ref for ref in iter_dump_tensors({"data": {entry: dump.data[entry]}}) if ref.role == "output"]
    assert torch.isnan(torch.from_numpy(dump.load_tensor(outputs[0]))).sum() == 1


def test_a_transient_anomaly_is_told_apart(tmp_path):
    model, opt = gpt_and_adam()
    monitor, calls = None, []

    def once(module, args, output):  # a flaky fault: only the first time step 3 runs
        if monitor.step == 3 and not calls:
            calls.append(1)
            output = output.clone()
            output.view(-1)[0] = float("inf")
            return output
    model.get_submodule("layers.0.mlp.2").register_forward_hook(once)
    monitor = TorchMonitor(model, opt, config(tmp_path))
    run(model, opt, monitor, 4)
    monitor.close()
    replay = read_incident(tmp_path / INCIDENT)["replay"]
    assert replay["status"] == "transient" and replay["checks"][0]["replay_value"] == 0


def test_the_decorator_form(tmp_path):
    model, opt = gpt_and_adam()
    monitor = None
    inject(model, "head", lambda: monitor.step, 3, "nan")
    monitor = TorchMonitor(model, opt, config(tmp_path))

    @monitor.replayable
    def train_step(tokens, targets):
        opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        return loss

    tokens = torch.randint(0, model.cfg.vocab, (2, model.cfg.seq + 1))
    for _ in range(4):
        monitor.step_end(train_step(tokens[:, :-1], tokens[:, 1:]))
    monitor.close()
    assert train_step.__name__ == "train_step"
    assert read_incident(tmp_path / INCIDENT)["replay"]["status"] == "reproducible"


def test_a_step_that_fails_when_replayed_is_reported_and_training_goes_on(tmp_path):
    model, opt = gpt_and_adam()
    monitor = None
    inject(model, "layers.1.mlp.0", lambda: monitor.step, 3, "nan")
    monitor = TorchMonitor(model, opt, config(tmp_path))

    def fragile():
        if monitor.replaying:
            raise ValueError("the data loader is exhausted")
    losses = run(model, opt, monitor, 5, on_step=fragile)
    monitor.close()
    replay = read_incident(tmp_path / INCIDENT)["replay"]
    assert replay["status"] == "failed" and "ValueError: the data loader is exhausted" in replay["detail"]
    assert len(losses) == 5 and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("through_run_step,replay,why", [
    (False, True, "the step was not run through Monitor.run_step"),
    (True, False, "incidents.replay.enabled is false"),
])
def test_why_a_step_was_not_replayed(tmp_path, through_run_step, replay, why):
    model, opt = gpt_and_adam()
    monitor = None
    inject(model, "layers.1.mlp.0", lambda: monitor.step, 3, "nan")
    monitor = TorchMonitor(model, opt, config(tmp_path, incidents={"replay": {"enabled": replay}}))
    run(model, opt, monitor, 4, through_run_step=through_run_step)
    monitor.close()
    assert read_incident(tmp_path / INCIDENT)["replay"] == {
        "status": "not_run", "detail": why, "checks": [], "dump": None, "seconds": 0.0}
