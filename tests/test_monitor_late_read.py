"""One-step-late reads (the GPU path, exercised on CPU), host syncs per step, self-metering."""
import numpy as np
import torch
from torch import nn

from msprobe_integrations.torch import TorchMonitor
from sink_helpers import untimed

WATCH = {"module_outputs": True, "activation_grads": True, "param_grads": True, "params": True,
         "optimizer_state": ["exp_avg", "exp_avg_sq", "update"]}
METER = ("monitor/overhead_ms", "monitor/host_syncs", "monitor/tensors")


class AttentionNet(nn.Module):
    def __init__(self, dim: int = 32, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        logits = self.head(x + self.mlp(x))
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def run(tmp_path, name, steps, read_late, alerts=None, syncs_in_step=None):
    torch.manual_seed(0)
    model = AttentionNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"output_dir": str(tmp_path / name), "sinks": ["jsonl"], "strict": True, "watch": WATCH}
    if alerts is not None:
        config["alerts"] = alerts
    monitor = TorchMonitor(model, opt, config)
    monitor.monitor.read_late = read_late
    if syncs_in_step is not None:  # host syncs counted when the optimizer step has run
        opt.register_step_post_hook(lambda *_: syncs_in_step.append(monitor.host_syncs))
    tokens = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(1))
    losses, returned, emitted = [], [], []
    for _ in range(steps):
        loss = model(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        returned.append(monitor.step_end(loss))
        emitted.append(len(monitor.history))
        losses.append(loss.detach().clone())
    monitor.close()
    return monitor, torch.stack(losses), returned, emitted


def test_one_step_late_reads_give_the_same_records_without_host_syncs(tmp_path):
    sync, sync_losses, sync_returned, _ = run(tmp_path, "sync", 4, read_late=False)
    late, late_losses, late_returned, emitted = run(tmp_path, "late", 4, read_late=True)
    assert torch.equal(sync_losses, late_losses)
    assert all(r is not None for r in sync_returned) and all(r is None for r in late_returned)
    assert emitted == [0, 1, 2, 3]  # each step's record comes at the next step's end, the last at close
    assert [r.step for r in late.history] == [0, 1, 2, 3]
    assert sync.host_syncs == 4 and late.host_syncs == 0
    assert sync.transfers == late.transfers == 4
    for a, b in zip(sync.history, late.history):
        assert untimed(a.metrics) and untimed(a.metrics) == untimed(b.metrics)
        assert a.metrics["monitor/host_syncs"] == 1 and b.metrics["monitor/host_syncs"] == 0
        assert a.metrics["monitor/tensors"] == b.metrics["monitor/tensors"] > 0
        assert a.metrics["monitor/overhead_ms"] > 0 and b.metrics["monitor/overhead_ms"] > 0


def test_a_rule_that_can_skip_keeps_one_synchronous_read_before_the_optimizer_step(tmp_path):
    syncs: list[int] = []
    alerts = [{"rule": "non_finite", "action": "skip"}]
    monitor, _, returned, _ = run(tmp_path, "skip", 3, read_late=True, alerts=alerts, syncs_in_step=syncs)
    assert syncs == [1, 2, 3]  # one blocking read per step, before the weights change
    assert monitor.host_syncs == 4  # and one at close, for the last step's post-step rows
    assert [r.metrics["monitor/host_syncs"] for r in monitor.history] == [1, 1, 1]
    assert all(r is None for r in returned)  # the post-step rows join the record at the next transfer


def test_self_metering_counts_the_tensors_measured(tmp_path):
    monitor, _, _, _ = run(tmp_path, "count", 2, read_late=False)
    record = monitor.history[-1]
    params = sum(1 for _ in AttentionNet().parameters())
    # grads, params, exp_avg, exp_avg_sq and updates of every parameter, the loss, and module
    # outputs/output gradients (some outputs repeat an earlier row and are not measured again)
    assert record.metrics["monitor/tensors"] >= 5 * params + 1
    assert np.isfinite(record.metrics["monitor/overhead_ms"])
    assert all(tag in record.metrics for tag in METER)
