"""The Lightning callback with the real Lightning Trainer (random-init GPT-2 in a
LightningModule, CPU): gradients against a plain-torch replay, a nan in a named layer
(skip, stop), resume from a checkpoint, what it cannot read."""
import copy
import logging
import math

import pytest
import torch

from tests.trainer_helpers import (GAS, LIT_LAYER, action_config, incidents, lightning_run,
                                   lightning_skip_then_stop_run, lit_module)

pytestmark = pytest.mark.slow  # each test runs the real Lightning Trainer (a few seconds)


def test_gradients_are_read_before_clipping_and_equal_a_plain_torch_replay(tmp_path):
    module = lit_module()
    reference = copy.deepcopy(module.gpt)
    batches = []
    capture = module.gpt.register_forward_pre_hook(
        lambda m, a, kw: batches.append(copy.deepcopy(kw)) if m.training else None, with_kwargs=True)
    callback, _ = lightning_run(tmp_path, action_config(tmp_path), module=module, max_steps=1,
                                gradient_clip_val=0.05)
    capture.remove()
    assert len(batches) == GAS
    losses = []
    for kwargs in batches:  # Lightning divides each micro-batch's loss by the accumulation count
        loss = reference(**kwargs).loss
        (loss / GAS).backward()
        losses.append(loss.item())
    (record,) = callback.monitor.history
    assert record.micro_steps == GAS
    grads = {f"gpt.{n}": p.grad.double() for n, p in reference.named_parameters()}
    for name, grad in grads.items():
        for stat, value in (("norm", grad.norm()), ("max", grad.max()), ("min", grad.min())):
            assert record.metrics[f"grad/{name}/{stat}"] == pytest.approx(value.item(), rel=1e-5), (name, stat)
    total = torch.stack([g.norm() for g in grads.values()]).norm().item()
    assert total > 10 * 0.05 and record.metrics["grad/global/norm"] == pytest.approx(total, rel=1e-5)
    assert record.metrics["train/loss"] == pytest.approx(sum(losses) / GAS, rel=1e-5)


def test_a_nan_in_a_layer_is_named_in_the_incident_and_its_step_skipped(tmp_path):
    callback, trainer = lightning_run(tmp_path, action_config(tmp_path, "skip"), faults={1})
    records = list(callback.monitor.history)
    assert [r.step for r in records] == [1, 2, 3] and trainer.global_step == 3
    assert [r.micro_steps for r in records] == [GAS] * 3
    assert math.isnan(records[1].metrics[f"actv/{LIT_LAYER}/output/norm"])
    assert math.isfinite(records[2].metrics["grad/global/norm"])
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
    (incident,) = incidents(tmp_path).values()
    assert (incident["step"], incident["action"]) == (2, "skip")
    assert (incident["culprit"]["phase"], incident["culprit"]["call"]) == ("forward", LIT_LAYER)


def test_skip_then_stop_through_should_stop(tmp_path):
    """The lifecycle run: step 2 skipped (a nan), step 3 stopped (a loss spike)."""
    callback, trainer = lightning_skip_then_stop_run(tmp_path)
    assert trainer.should_stop and trainer.global_step == 3
    records = list(callback.monitor.history)
    assert [(r.step, r.micro_steps) for r in records] == [(1, GAS), (2, GAS), (3, GAS)]
    assert [(a.rule, a.phase, a.step) for r in records for a in r.alerts] == [
        ("non_finite", "start", 2), ("non_finite", "end", 3), ("spike", "start", 3)]
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
    found = incidents(tmp_path)
    assert [(i["step"], i["rule"], i["action"]) for i in found.values()] == [(2, "non_finite", "skip"),
                                                                            (3, "spike", "stop")]


def test_resume_from_a_checkpoint_keeps_the_open_alert_episode(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    config = action_config(tmp_path / "run", "skip")
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first, _ = lightning_run(tmp_path, config, faults={1, 2, 3}, max_steps=4, callbacks=[saver])
    assert [(a.step, a.phase) for r in first.monitor.history for a in r.alerts] == [(2, "start")]
    (checkpoint,) = [p for p in (tmp_path / "ckpt").iterdir() if "step=2" in p.name]
    saved = torch.load(checkpoint, weights_only=False)["callbacks"]
    assert [state["step"] for key, state in saved.items() if key.startswith("MonitorCallback")] == [3]
    resumed, trainer = lightning_run(tmp_path, config, faults={0, 1}, max_steps=4, ckpt_path=str(checkpoint),
                                     callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt2")])
    records = list(resumed.monitor.history)
    assert [r.step for r in records] == [3, 4] and trainer.global_step == 4
    assert all(math.isnan(r.metrics[f"actv/{LIT_LAYER}/output/norm"]) for r in records)
    assert [a for r in records for a in r.alerts] == []  # the episode open at the checkpoint goes on
    assert [r.metrics["Health/alerts"] for r in records] == [1.0, 1.0]  # the count before the checkpoint goes on
    assert float(trainer.callback_metrics["msprobe/alerts"]) == 1.0
    assert list(incidents(tmp_path / "run")) == ["step2-rank0-non_finite"]


def test_manual_optimization_is_named_in_a_warning(tmp_path, caplog):
    module = lit_module()
    module.automatic_optimization = False

    def training_step(batch, batch_idx):
        optimizer = module.optimizers()
        loss = module.gpt(**batch).loss
        optimizer.zero_grad()
        module.manual_backward(loss)
        optimizer.step()

    module.training_step = training_step
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        callback, _ = lightning_run(tmp_path, action_config(tmp_path), module=module, max_steps=2,
                                    accumulate_grad_batches=1)
    assert "manual optimization (automatic_optimization = False): gradients, optimizer state and actions " \
           "are not monitored" in caplog.text
    records = list(callback.monitor.history)
    assert [r.step for r in records] == [1, 2]
    assert f"actv/{LIT_LAYER}/output/norm" in records[0].metrics  # activations still are
    assert not any(tag.startswith(("grad/", "optim/")) for tag in records[0].metrics)


def test_ddp_ranks_agree_on_a_skip_only_one_rank_saw(tmp_path):
    from tests.multiproc import run_ranks
    from tests.trainer_helpers import check_ddp_agreement, ddp_rank

    results = run_ranks(ddp_rank, 2, str(tmp_path), "lightning", timeout=300)
    check_ddp_agreement(results)
