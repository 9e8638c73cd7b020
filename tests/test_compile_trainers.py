"""The trainer callbacks with compiled models: the HF Trainer with `torch_compile=True` and Lightning
with a `torch.compile`d submodule. The monitor adds no graph break and no graph to what the model
compiles to without it, the activations are measured in the graph (they change every step), and
the loss and micro-steps are those of the eager run."""
import pytest
import torch
import torch._dynamo

from tests.trainer_helpers import LAYER, LIT_LAYER, action_config, gpt2, hf_args, lightning_run, lit_module, \
    token_rows

pytestmark = pytest.mark.slow  # compiles GPT-2 twice per test (a minute or more on a loaded 2-core machine)
#: the asserts are Dynamo-level (graph breaks, graphs, statistics changing at run time), so the graphs go
#: through AOT autograd only; inductor's fusion of the statistics is tested in test_compile.py
BACKEND = "aot_eager"

CONFIG = {"watch": {"module_outputs": True, "activation_grads": True, "param_grads": True,
                    "optimizer_state": ["exp_avg", "exp_avg_sq"]}}


def compiled_counts() -> tuple[int, int]:
    counters = torch._dynamo.utils.counters
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def fresh() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def test_lightning_with_a_compiled_module(tmp_path):
    import lightning.pytorch as pl

    fresh()
    module = lit_module()
    module.gpt = torch.compile(module.gpt, backend=BACKEND)
    lightning_run(tmp_path / "plain", None, module=module, callback_type=lambda config: pl.Callback())
    plain_counts = compiled_counts()
    fresh()
    module = lit_module()
    module.gpt = torch.compile(module.gpt, backend=BACKEND)
    callback, _ = lightning_run(tmp_path / "ours", action_config(tmp_path / "ours", **CONFIG), module=module)
    breaks, graphs = compiled_counts()
    # the same graph breaks and graphs: the model's own (no fault hooks: none is asked for)
    assert (breaks, graphs) == plain_counts
    records = list(callback.monitor.history)
    assert [r.step for r in records] == [1, 2, 3]  # the trainer's global_step after each optimizer step
    norms = [r.metrics[f"actv/{LIT_LAYER}/output/norm"] for r in records]
    assert len(set(norms)) == 3
    assert not [t for t in records[0].metrics if "_orig_mod" in t]


def hf_compiled(out, callback):
    """3 optimizer steps of 2 micro-batches of GPT-2 with `torch_compile=True` (no fault hooks:
    trainer_helpers' FaultAt counts forwards in a Python attribute, which recompiles every call)."""
    from transformers import Trainer

    fresh()
    trainer = Trainer(model=gpt2(), args=hf_args(out, torch_compile=True, torch_compile_backend=BACKEND), train_dataset=token_rows(24),
                      callbacks=[callback])
    trainer.train()
    return compiled_counts()


def test_hf_trainer_with_torch_compile(tmp_path):
    from transformers import TrainerCallback

    from msprobe_integrations.hf import MonitorCallback

    plain = hf_compiled(tmp_path / "plain", TrainerCallback())
    callback = MonitorCallback(action_config(tmp_path / "ours", **CONFIG))
    ours = hf_compiled(tmp_path / "ours", callback)
    assert ours == plain  # the model's own graph breaks and graphs, nothing recompiled for the monitor
    records = list(callback.monitor.history)
    assert [r.step for r in records] == [1, 2, 3] and [r.micro_steps for r in records] == [2, 2, 2]
    losses = [r.metrics["train/loss"] for r in records]
    assert all(torch.isfinite(torch.tensor(losses))) and len(set(losses)) == 3
    norms = [r.metrics[f"actv/{LAYER}/output/norm"] for r in records]
    assert len(set(norms)) == 3  # measured at run time
