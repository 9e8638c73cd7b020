"""accelerate: the two documented lines (docs/accelerate.md) with a real `Accelerator` loop and
gradient accumulation: one record per optimizer step, gradients equal to a plain-torch replay."""
import copy

import pytest
import torch

from tests.trainer_helpers import GAS, gpt2, token_rows

pytestmark = pytest.mark.slow  # accelerate and transformers imports (a few seconds)


def test_two_lines_monitor_an_accelerator_loop_with_accumulation(tmp_path):
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from msprobe_integrations.torch import TorchMonitor

    model = gpt2()
    reference = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GAS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, data = accelerator.prepare(model, optimizer, DataLoader(token_rows(8), batch_size=2))
    # the two lines of docs/accelerate.md
    monitor = TorchMonitor(accelerator.unwrap_model(model), optimizer.optimizer,
                           config={"output_dir": str(tmp_path), "sinks": ["jsonl"], "strict": True})
    batches = []
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        batches.append(batch)
        if accelerator.sync_gradients:
            monitor.step_end(loss)
    monitor.close()
    assert [(r.step, r.micro_steps) for r in monitor.history] == [(0, GAS), (1, GAS)]
    for batch in batches[:GAS]:  # accelerate divides each micro-batch's loss by the accumulation count
        (reference(**batch).loss / GAS).backward()
    first = monitor.history[0].metrics
    for name, p in reference.named_parameters():
        assert first[f"grad/{name}/norm"] == pytest.approx(p.grad.norm().item(), rel=1e-5), name
