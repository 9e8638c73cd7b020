"""The HF Trainer callback with the real Trainer (random-init GPT-2, CPU): pre-clip gradients
against a plain-torch replay, a nan in a named layer (skip, stop), resume from a checkpoint,
bad input; HF Trainer + DeepSpeed ZeRO-2 on 2 ranks."""
import copy
import json
import logging
import math

import numpy as np
import pytest
import torch

from tests.multiproc import run_ranks
from tests.trainer_helpers import (GAS, LAYER, action_config, check_ddp_agreement, gpt2, hf_ddp_rank, hf_run,
                                   hf_skip_then_stop_run, incidents)

pytestmark = pytest.mark.slow  # each test trains with the real Trainer (a few seconds, most of it imports)


def test_gradients_are_read_before_clipping_and_equal_a_plain_torch_replay(tmp_path):
    """max_grad_norm far below the gradient norm: the Trainer clips, we report the unclipped."""
    model = gpt2()
    reference_model = copy.deepcopy(model)
    calls, param_hooks = [], []

    def capture_call(module, args, kwargs):
        if module.training:
            calls.append(copy.deepcopy(kwargs))
            param_hooks.append(sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters()))

    capture = model.register_forward_pre_hook(capture_call, with_kwargs=True)
    callback, _ = hf_run(tmp_path, action_config(tmp_path), model=model, max_steps=1, max_grad_norm=0.05)
    capture.remove()
    assert len(calls) == GAS
    assert param_hooks == [0] * GAS  # read in one batch at the backward's end, no hook per parameter
    for kwargs in calls:  # the same micro-batches through the model's own forward, plain torch
        loss = reference_model(**kwargs).loss
        (loss if kwargs.get("num_items_in_batch") is not None else loss / GAS).backward()
    (record,) = callback.monitor.history
    assert record.micro_steps == GAS
    grads = {n: p.grad.double() for n, p in reference_model.named_parameters()}
    for name, grad in grads.items():
        for stat, value in (("norm", grad.norm()), ("max", grad.max()), ("min", grad.min())):
            assert record.metrics[f"grad/{name}/{stat}"] == pytest.approx(value.item(), rel=1e-5), (name, stat)
        # a mean near 0 (the embedding's, by the softmax): relative to the size of the elements
        assert record.metrics[f"grad/{name}/mean"] == pytest.approx(grad.mean().item(),
                                                                    abs=1e-5 * grad.abs().mean().item()), name
    total = torch.stack([g.norm() for g in grads.values()]).norm().item()
    assert total > 10 * 0.05  # the Trainer did clip: what we report is not what it clipped to
    assert record.metrics["grad/global/norm"] == pytest.approx(total, rel=1e-5)
    with torch.no_grad():  # the step's loss as the Trainer logs it (shares of the step's tokens)
        shares = [reference_model(**kw).loss.item() for kw in calls]
    assert calls[0].get("num_items_in_batch") is not None
    assert record.metrics["train/loss"] == pytest.approx(sum(shares), rel=1e-5)


def test_a_nan_in_a_layer_is_named_in_the_incident_and_its_step_skipped(tmp_path):
    callback, trainer = hf_run(tmp_path, action_config(tmp_path, "skip"), faults={1})
    records = list(callback.monitor.history)
    assert [r.step for r in records] == [1, 2, 3] and trainer.state.global_step == 3
    assert math.isnan(records[1].metrics[f"actv/{LAYER}/output/norm"])
    assert math.isfinite(records[2].metrics["grad/global/norm"])  # the nan step did not reach the weights
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    (incident,) = incidents(tmp_path).values()
    assert (incident["step"], incident["rule"], incident["action"]) == (2, "non_finite", "skip")
    assert (incident["culprit"]["phase"], incident["culprit"]["call"]) == ("forward", LAYER)


def test_skip_then_stop_through_the_trainer(tmp_path):
    """The lifecycle run: step 2 skipped (a nan), step 3 stopped (a loss spike); the Trainer
    ends after the stopping step, as after its last, and the stopping step is not applied."""
    callback, trainer = hf_skip_then_stop_run(tmp_path)
    assert trainer.state.global_step == 3 and trainer.args.max_steps == 6
    records = list(callback.monitor.history)
    assert [(r.step, r.micro_steps) for r in records] == [(1, GAS), (2, GAS), (3, GAS)]
    assert [(a.rule, a.phase, a.step) for r in records for a in r.alerts] == [
        ("non_finite", "start", 2), ("non_finite", "end", 3), ("spike", "start", 3)]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    found = incidents(tmp_path)
    assert [(i["step"], i["rule"], i["action"]) for i in found.values()] == [(2, "non_finite", "skip"),
                                                                            (3, "spike", "stop")]


def test_resume_from_a_checkpoint_keeps_the_open_alert_episode(tmp_path):
    """A nan from step 2 on; checkpoint at step 2. The resumed run is inside the same episode:
    no new alert start, no new incident. (A fresh monitor would start one at step 3.)"""
    config = action_config(tmp_path / "run", "skip")
    saving = dict(save_strategy="steps", save_steps=2, max_steps=4)
    first, _ = hf_run(tmp_path, config, faults={1, 2, 3}, **saving)
    starts = [(a.step, a.phase) for r in first.monitor.history for a in r.alerts]
    assert starts == [(2, "start")]
    saved = json.loads((tmp_path / "trainer" / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["MonitorCallback"]["attributes"]["msprobe_state"]["step"] == 3  # the next step's
    resumed, trainer = hf_run(tmp_path, config, faults={0, 1}, resume=str(tmp_path / "trainer" / "checkpoint-2"),
                              **saving)  # fault steps count from the resumed run's first step
    records = list(resumed.monitor.history)
    assert [r.step for r in records] == [3, 4] and trainer.state.global_step == 4
    assert all(math.isnan(r.metrics[f"actv/{LAYER}/output/norm"]) for r in records)
    assert [a for r in records for a in r.alerts] == []
    assert [r.metrics["Health/alerts"] for r in records] == [1.0, 1.0]  # the count before the checkpoint goes on
    assert list(incidents(tmp_path / "run")) == ["step2-rank0-non_finite"]


def test_an_optimizer_it_cannot_read_is_named_in_a_warning(tmp_path, caplog):
    class Opaque:  # not a torch.optim.Optimizer
        def __init__(self, params):
            self.inner = torch.optim.SGD(params, lr=1e-3)
            self.param_groups = self.inner.param_groups

        def step(self):
            self.inner.step()

        def zero_grad(self, set_to_none=True):
            self.inner.zero_grad(set_to_none)

    class ConstantLr:
        def step(self):
            pass

        def get_last_lr(self):
            return [1e-3]

    model = gpt2()
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        callback, _ = hf_run(tmp_path, action_config(tmp_path), model=model, max_steps=1,
                             optimizers=(Opaque(model.parameters()), ConstantLr()))
    assert "optimizer (Opaque) is not a torch.optim.Optimizer: optimizer state and parameters after the step " \
           "are not monitored" in caplog.text
    (record,) = callback.monitor.history
    assert "grad/global/norm" in record.metrics  # gradients and activations are still read
    assert not any(tag.startswith("optim/") for tag in record.metrics)


# ---- HF Trainer + DeepSpeed ZeRO-2, 2 ranks ------------------------------------------------------
def _deepspeed_rank(rank: int, world: int, out: str) -> dict:
    """ZeRO-2, then ZeRO-3, each a Trainer whose monitor config is the DeepSpeed config's block."""
    from pathlib import Path

    from accelerate.state import AcceleratorState

    from examples.deepspeed_train import init_distributed
    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    init_distributed()
    results = {}
    for stage in (2, 3):
        root = Path(out) / f"zero{stage}"
        ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                     "zero_optimization": {"stage": stage}, "gradient_clipping": "auto",
                     "msprobe": action_config(root / "monitor", "skip")}  # the monitor, from the DeepSpeed config
        AcceleratorState._reset_state(True)  # a new DeepSpeed plugin for this Trainer
        callback, trainer = hf_run(root, None, faults={1}, deepspeed=ds_config, max_steps=3, rows=48, logging_steps=1)
        history = list(callback.monitor.history)
        results[stage] = {"adapter": isinstance(callback.monitor, DeepSpeedMonitor),
                          "steps": [r.step for r in history],
                          "logged": [entry["step"] for entry in trainer.state.log_history if "loss" in entry],
                          "norms": [r.metrics[f"actv/{LAYER}/output/norm"] for r in history],
                          "numel": history[0].metrics[f"actv/{LAYER}/output/numel"],
                          "exp_avg": [r.metrics["optim/transformer.h.0.mlp.c_fc.weight/exp_avg/norm"] for r in history],
                          "global_step": trainer.state.global_step,
                          "incidents": incidents(root / "monitor")}
    return results


def test_deepspeed_zero2_and_zero3_on_two_ranks_merge_and_name_the_layer(tmp_path):
    results = run_ranks(_deepspeed_rank, 2, str(tmp_path), timeout=400, env={"DS_ACCELERATOR": "cpu"})
    for rank, by_stage in enumerate(results):
        for stage, result in by_stage.items():
            assert result["adapter"] and result["global_step"] == 3, stage
            # the Trainer's global_step, as without DeepSpeed; every rank holds the merged records
            assert result["steps"] == result["logged"] == [1, 2, 3], stage
            assert math.isnan(result["norms"][1]) and math.isfinite(result["norms"][2]), stage
            # merged over the ranks: both ranks' micro-batches (2 ranks x GAS x 2 rows x 16 tokens x 32)
            assert result["numel"] == 2 * GAS * 2 * 16 * 32, stage
            assert result["exp_avg"][1] == result["exp_avg"][0] != result["exp_avg"][2], stage  # step 2 skipped
            incident = result["incidents"][f"step2-rank{rank}-non_finite"]
            assert (incident["action"], incident["culprit"]["call"]) == ("skip", LAYER), stage
    numbers = [{stage: {k: v for k, v in r.items() if k != "incidents"} for stage, r in by_stage.items()}
               for by_stage in results]
    np.testing.assert_equal(numbers[0], numbers[1])  # the ranks' records are the same merged ones (nan == nan)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    """Two DDP ranks (`hf_ddp_rank`), run once for the tests below."""
    return run_ranks(hf_ddp_rank, 2, str(tmp_path_factory.mktemp("ddp")), timeout=300)


def test_ddp_ranks_agree_on_a_skip_only_one_rank_saw(ddp_results):
    check_ddp_agreement(ddp_results)


def test_ddp_gradients_are_unscaled_when_the_trainer_does_not_clip(ddp_results):
    """A GradScaler and max_grad_norm=0: the gradients still hold the loss scale at
    on_pre_optimizer_step; the monitor's norm is the unscaled one measured by hand."""
    for result in ddp_results:
        measured, by_hand = result["scaled_norm"]
        assert measured == pytest.approx(by_hand, rel=1e-6)
