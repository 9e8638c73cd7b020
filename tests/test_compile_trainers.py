"""The trainer callbacks on compiled models: the HF Trainer with `torch_compile=True` and Lightning
with a `torch.compile`d module. The monitor adds no graph break and no graph to what the model
compiles to without it, the activations are measured in the graph (they change every step), and
the HF Trainer's loss is the one of its run without the monitor."""
import pytest
import torch
import torch._dynamo

from tests.trainer_helpers import (LAYER, LIT_LAYER, action_config, gpt2, hf_args, hf_run, lightning_run, lit_module,
                                   token_rows)

pytestmark = pytest.mark.slow  # each test compiles GPT-2 twice with inductor (about a minute here)

CONFIG = {"watch": {"module_outputs": True, "activation_grads": True, "param_grads": True,
                    "optimizer_state": ["exp_avg", "exp_avg_sq"]}}


def compiled_counts() -> tuple[int, int]:
    counters = torch._dynamo.utils.counters
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def fresh() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def test_hf_trainer_with_torch_compile(tmp_path):
    from transformers import Trainer

    fresh()
    plain = Trainer(model=gpt2(), args=hf_args(tmp_path / "plain", torch_compile=True), train_dataset=token_rows(24))
    plain.train()
    plain_counts = compiled_counts()
    fresh()
    callback, trainer = hf_run(tmp_path / "ours", action_config(tmp_path / "ours", **CONFIG), torch_compile=True)
    assert compiled_counts() == plain_counts
    records = list(callback.monitor.history)
    assert [r.step for r in records] == [0, 1, 2]
    norms = [r.metrics[f"actv/{LAYER}/output/norm"] for r in records]
    assert len(set(norms)) == 3
    assert f"actv_grad/{LAYER}/output/norm" in records[0].metrics
    assert records[-1].metrics["grad/global/norm"] > 0
    assert trainer.state.log_history[-1]["train_loss"] == plain.state.log_history[-1]["train_loss"]


def test_lightning_with_a_compiled_module(tmp_path):
    import lightning.pytorch as pl

    fresh()
    module = lit_module()
    module.gpt = torch.compile(module.gpt)
    lightning_run(tmp_path / "plain", None, module=module, callback_type=lambda config: pl.Callback())
    plain_counts = compiled_counts()
    fresh()
    module = lit_module()
    module.gpt = torch.compile(module.gpt)
    callback, _ = lightning_run(tmp_path / "ours", action_config(tmp_path / "ours", **CONFIG), module=module)
    assert compiled_counts() == plain_counts
    records = list(callback.monitor.history)
    assert [r.step for r in records] == [0, 1, 2]
    norms = [r.metrics[f"actv/{LIT_LAYER}/output/norm"] for r in records]
    assert len(set(norms)) == 3
    assert not [t for t in records[0].metrics if "_orig_mod" in t]
