"""Forward hooks' CPU tensors measured together at the forward's end (`later_rows`): the same
rows as measured at each hook, also for an output changed in place after its hook."""
import logging

import numpy as np
import torch
from torch import nn

from examples.tiny_gpt import TinyGPT
from msprobe_engine.frameworks.torch import backend
from msprobe_integrations.torch import TorchMonitor
from tests.test_monitor_torch import EVERYTHING, train


class ScaledInPlace(nn.Module):
    """`a`'s output is tripled in place after its hook (from step `from_step` on; 0: always)."""

    def __init__(self, from_step: int = 0) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 1)
        self.from_step, self.calls = from_step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.a(x)
        if self.calls > self.from_step:
            h.mul_(3.0)
        return self.b(torch.relu(h)).mean()


def run_scaled(tmp_path, from_step):
    """Five steps of `ScaledInPlace`: the records' statistics of `a`'s output, and its
    statistics as its hook saw it (a hook after the monitor's, in float64)."""
    torch.manual_seed(0)
    model = ScaledInPlace(from_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TorchMonitor(model, opt, {**EVERYTHING, "output_dir": str(tmp_path)})
    seen = []
    model.a.register_forward_hook(lambda m, args, out: seen.append((out.double().max().item(),
                                                                    out.double().norm().item())))
    got = []
    for step in range(5):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).backward()
        opt.step()
        metrics = monitor.step_end().metrics
        got.append((metrics["actv/a/output/max"], metrics["actv/a/output/norm"]))
    monitor.close()
    return np.array(got), np.array(seen), monitor


def test_an_output_changed_in_place_after_its_hook_is_measured_as_its_hook_saw_it(tmp_path):
    got, seen, monitor = run_scaled(tmp_path, from_step=0)
    np.testing.assert_allclose(got, seen, rtol=1e-6)
    assert "actv:a:output" in {":".join(key) for key in monitor.rows.later.changed}
    assert "actv:b:output" in {":".join(key) for key in monitor.rows.later.proven}  # b's rows waited


def test_a_change_in_place_from_a_later_step_is_warned_and_measured_at_the_hook_after(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        got, seen, _ = run_scaled(tmp_path, from_step=2)
    np.testing.assert_allclose(got[:2], seen[:2], rtol=1e-6)
    np.testing.assert_allclose(got[2], 3 * seen[2], rtol=1e-6)  # changed after it was proven: as at the settle
    np.testing.assert_allclose(got[3:], seen[3:], rtol=1e-6)
    assert sum("changed after its hook" in r.getMessage() for r in caplog.records) == 1


def test_rows_measured_together_equal_rows_measured_at_each_hook(tmp_path, monkeypatch):
    def records(path):
        torch.manual_seed(0)
        model = TinyGPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        monitor = TorchMonitor(model, opt, {**EVERYTHING, "output_dir": str(path)})
        out = []
        monitor.step_end_listeners.append(lambda record: out.append(record.metrics))
        losses = train(model, opt, 4, monitor, accumulate=2)
        monitor.close()
        return out, losses, monitor

    together, losses, monitor = records(tmp_path / "together")
    assert len(monitor.rows.later.proven) > 20
    monkeypatch.setattr(backend, "LaterRows", None)
    alone, losses_alone, monitor = records(tmp_path / "alone")
    assert monitor.rows.later is False
    assert torch.equal(losses, losses_alone)
    assert [sorted(m) for m in together] == [sorted(m) for m in alone]
    for step, (a, b) in enumerate(zip(together, alone)):
        differ = [(k, a[k], b[k]) for k in sorted(a) if not (a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]))
                  and "monitor" not in k]  # the monitor's own time
        assert differ == [], step
