"""Shared set-up of the trainer-callback tests (HF Trainer, Lightning): tiny models, data,
a nan injected into a named layer at a chosen optimizer step, and one-call drivers.

The drivers (`hf_run`, `lightning_run`) train with gradient accumulation 2 and return
(callback, trainer); `callback.monitor` holds the run's history and incidents. `faults`:
the optimizer steps whose `LAYER` output is nan; `spikes`: those whose logits are 100 times
too large (a loss spike). `hf_skip_then_stop_run` / `lightning_skip_then_stop_run`: step 0
as usual, step 1 skipped, step 2 stopped. `hf_lifecycle` / `lightning_lifecycle`: runners
for tests/test_lifecycle_order.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: the layer whose output is made nan (GPT-2 naming; the Lightning model uses the same path)
LAYER = "transformer.h.1.mlp"
GAS = 2
SEQ = 16
MICRO_BATCH = 2


# ---- models and data ---------------------------------------------------------------------
def gpt2(seed: int = 0):
    """A random-init GPT-2 (no download), without dropout so that runs are reproducible."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def token_rows(count: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        ids = torch.randint(1, 64, (SEQ,), generator=generator)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


class FaultAt:
    """A forward hook on `module` that corrupts its output on the given optimizer steps
    (counting training forwards of `root`, `GAS` per step): nan, or times `scale`; with
    `backward`, the output's gradient instead (the forward stays finite: an fp16 backward's
    overflow, with `scale` inf)."""

    def __init__(self, root: torch.nn.Module, module: torch.nn.Module, steps: set[int], gas: int = GAS,
                 scale: float = float("nan"), backward: bool = False) -> None:
        self.forwards, self.steps, self.gas, self.scale, self.backward = 0, steps, gas, scale, backward
        self.handles = [root.register_forward_pre_hook(self._count),
                        module.register_forward_hook(self._corrupt)]

    def _count(self, module, args) -> None:
        if module.training:
            self.forwards += 1

    def _corrupt(self, module, args, output):
        if module.training and (self.forwards - 1) // self.gas in self.steps:
            if self.backward:
                output.register_hook(lambda grad: grad * self.scale)
                return None
            return output * self.scale
        return None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def faults_in(root: torch.nn.Module, nans: set[int], spikes: set[int], overflows: set[int] = frozenset()
              ) -> list[FaultAt]:
    """nan in `LAYER`'s output on the steps of `nans`; the final norm's output (the logits'
    scale: a loss spike) times 100 on the steps of `spikes`; `LAYER`'s output gradient inf on
    the steps of `overflows` (a loss-scaled backward's overflow). None when no step is given: a
    counting hook compiled into a model would recompile it at every forward (a Python counter)."""
    if not (nans or spikes or overflows):
        return []
    faults = [FaultAt(root, root.get_submodule(LAYER), set(nans)),
              FaultAt(root, root.get_submodule("transformer.ln_f"), set(spikes), scale=100.0)]
    if overflows:
        faults.append(FaultAt(root, root.get_submodule(LAYER), set(overflows), scale=float("inf"), backward=True))
    return faults


def action_config(out: Path, action: str = "continue", **overrides) -> dict:
    """Strict; jsonl only; a nan anywhere fires `non_finite` with `action`."""
    return {"strict": True, "output_dir": str(out), "sinks": ["jsonl"],
            "stats": ["min", "max", "mean", "norm", "numel", "nan_count"],
            "alerts": [{"rule": "non_finite", "action": action}], **overrides}


def incidents(out: Path) -> dict[str, dict]:
    """incident directory name -> incident.json, every rank's."""
    return {d.parent.name: json.loads(d.read_text()) for d in sorted(Path(out).glob("incidents/*/incident.json"))}


# ---- Hugging Face Trainer -----------------------------------------------------------------
def hf_args(out: Path, **overrides):
    from transformers import TrainingArguments

    options = dict(output_dir=str(out / "trainer"), use_cpu=True, report_to=[], save_strategy="no",
                   disable_tqdm=True, per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=GAS,
                   learning_rate=1e-3, max_steps=3, logging_steps=10 ** 6, seed=0, data_seed=0,
                   dataloader_num_workers=0)
    return TrainingArguments(**{**options, **overrides})


def hf_run(out: Path, config: Any, *, faults: set[int] = frozenset(), model=None, rows: int = 24,
           resume: str | None = None, optimizers=(None, None), spikes: set[int] = frozenset(),
           overflows: set[int] = frozenset(), callback_type: type | None = None, callbacks: list = (),
           scaler: Any = None, **args):
    """Train GPT-2 with the HF Trainer and `MonitorCallback(config)` (or `callback_type(config)`),
    then `callbacks`; `scaler`: a torch GradScaler for the Trainer's accelerator (accelerate
    builds one for fp16 on accelerators only); returns (callback, trainer)."""
    from transformers import Trainer

    from msprobe_integrations.hf import MonitorCallback

    model = model if model is not None else gpt2()
    injected = faults_in(model, faults, spikes, overflows)
    callback = (callback_type or MonitorCallback)(config=config)
    trainer = Trainer(model=model, args=hf_args(out, **args), train_dataset=token_rows(rows),
                      callbacks=[callback, *callbacks], optimizers=optimizers)
    if scaler is not None:
        trainer.accelerator.scaler = scaler
    trainer.train(resume_from_checkpoint=resume)
    for fault in injected:
        fault.remove()
    # the Trainer re-creates stateful callbacks on a resume with restore_callback_states_from_checkpoint
    (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, MonitorCallback)]
    return callback, trainer


def lifecycle_config(out: Path) -> dict:
    """Step 0 as usual; a nan in the activations at step 1 skips it; a loss spike at step 2 stops."""
    return action_config(out, alerts=[{"rule": "non_finite", "targets": ["actv"], "action": "skip"},
                                      {"rule": "spike", "metrics": ["train/loss"], "warmup": 1, "action": "stop"}])


def hf_skip_then_stop_run(out: Path):
    """Optimizer steps of GAS=2 micro-batches; step 1 skipped (a nan), step 2 stopped (a loss
    spike): the Trainer ends after 3 steps of max_steps=6. Returns (callback, trainer)."""
    return hf_run(out, lifecycle_config(out), faults={1}, spikes={2}, max_steps=6)


# ---- Lightning -----------------------------------------------------------------------------
#: the faulty layer's name inside the LightningModule (the GPT-2 is its `gpt` attribute)
LIT_LAYER = f"gpt.{LAYER}"


def lit_module(seed: int = 0, lr: float = 1e-3):
    """A LightningModule around the GPT-2 of `gpt2()`, AdamW; its loss is the model's own."""
    import lightning.pytorch as pl

    class LitGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = gpt2(seed)

        def training_step(self, batch, batch_idx):
            return self.gpt(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    return LitGPT()


def lightning_run(out: Path, config: Any, *, faults: set[int] = frozenset(), module=None, rows: int = 24,
                  ckpt_path: str | None = None, callbacks: list = (), spikes: set[int] = frozenset(),
                  overflows: set[int] = frozenset(), callback_type: type | None = None, **trainer_args):
    """`trainer.fit` with `MonitorCallback(config)` (or `callback_type(config)`), then
    `callbacks`, accumulation GAS; returns (callback, trainer)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from msprobe_integrations.lightning import MonitorCallback

    module = module if module is not None else lit_module()
    injected = faults_in(module.gpt, faults, spikes, overflows)
    callback = (callback_type or MonitorCallback)(config=config)
    saves = any(type(c).__name__ == "ModelCheckpoint" for c in callbacks)
    options = dict(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=GAS, logger=False,
                   enable_checkpointing=saves, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=str(out / "lightning"), num_sanity_val_steps=0)
    trainer = pl.Trainer(callbacks=[callback, *callbacks], **{**options, **trainer_args})
    trainer.fit(module, DataLoader(token_rows(rows), batch_size=MICRO_BATCH), ckpt_path=ckpt_path)
    for fault in injected:
        fault.remove()
    return callback, trainer


def lightning_skip_then_stop_run(out: Path):
    """As `hf_skip_then_stop_run`, under Lightning."""
    return lightning_run(out, lifecycle_config(out), faults={1}, spikes={2}, max_steps=6)


# ---- DDP on CPU (gloo), run in each rank by tests.multiproc.run_ranks ------------------------------
def ddp_rank(rank: int, world: int, out: str, trainer: str) -> dict:
    """A nan in rank 0's activations only, under a skip rule on activations alone: rank 1 sees
    nothing wrong (its gradients are nan through DDP's all-reduce, which the rule does not
    watch), so only the ranks' agreement makes it skip too. Returns what the test checks."""
    out = Path(out)
    config = action_config(out / "monitor", "skip", alerts=[{"rule": "non_finite", "action": "skip",
                                                               "targets": ["actv"]}])
    faults = {1} if rank == 0 else set()
    if trainer == "hf":
        callback, hf = hf_run(out, config, faults=faults, rows=48)
        params, world_size = list(hf.model.parameters()), hf.args.world_size
    else:
        callback, pl = lightning_run(out, config, faults=faults, rows=48, devices=world, strategy="ddp")
        params, world_size = list(pl.lightning_module.parameters()), pl.world_size
    return {"world": world_size, "steps": [r.step for r in callback.monitor.history],
            "alerts": [(a.step, a.phase) for r in callback.monitor.history for a in r.alerts],
            "finite": all(bool(torch.isfinite(p).all()) for p in params),
            "checksum": [float(p.detach().double().sum()) for p in params]}


def hf_ddp_rank(rank: int, world: int, out: str) -> dict:
    """Under the HF Trainer on DDP: `ddp_rank`'s run, then one step with a GradScaler and no
    clipping (`max_grad_norm=0`: accelerate does not unscale before on_pre_optimizer_step),
    with the global norm of the step's (averaged, loss-scaled) gradients taken there by hand."""
    from transformers import TrainerCallback

    result = ddp_rank(rank, world, out, "hf")
    scale, norms = 2.0 ** 10, []

    class GradNorm(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
            norms.append(float(torch.stack([g.norm() for g in grads]).norm()) / scale)

    scaled = Path(out) / "scaled"
    callback, _ = hf_run(scaled, action_config(scaled / "monitor"), rows=8, max_steps=1, max_grad_norm=0.0,
                         scaler=torch.amp.GradScaler("cpu", init_scale=scale), callbacks=[GradNorm()])
    (record,) = callback.monitor.history
    return {**result, "scaled_norm": (record.metrics["grad/global/norm"], norms[0])}


def check_ddp_agreement(results: list[dict]) -> None:
    """What `ddp_rank` returned: rank 0 alone alerted, yet both ranks skipped its step."""
    assert [r["world"] for r in results] == [2, 2]
    assert results[0]["alerts"] == [(2, "start"), (3, "end")] and results[1]["alerts"] == []
    assert all(r["finite"] and r["steps"] == [1, 2, 3] for r in results)  # rank 1 skipped the step too
    assert results[0]["checksum"] == results[1]["checksum"]


# ---- runners for tests/test_lifecycle_order.py (the scenario of tests/lifecycle_helpers.py) -----
def hf_lifecycle(out: Path, action: str) -> tuple[str, bool | None]:
    """The HF Trainer callback in the lifecycle scenario: 3 steps of 2 micro-batches, a nan at
    step 1 under `action`; returns (the calls as letters, whether step 1 left the weights unchanged)."""
    from transformers import TrainerCallback

    from msprobe_integrations.hf import MonitorCallback
    from tests.lifecycle_helpers import BAD_STEP, MICRO, STEPS, config, letters, record

    class Recorded(MonitorCallback):
        def on_train_begin(self, *args, **kwargs):
            super().on_train_begin(*args, **kwargs)
            self._calls = record(self.monitor.monitor)

    weights = _WeightsAt(BAD_STEP)

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            weights.before(state.global_step, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            weights.after(state.global_step - 1, model)

    callback, _ = hf_run(out, config(out, action), faults={BAD_STEP}, callback_type=Recorded, callbacks=[Watch()],
                         max_steps=STEPS, gradient_accumulation_steps=MICRO, rows=STEPS * MICRO * MICRO_BATCH)
    return letters(callback._calls), weights.unchanged


def lightning_lifecycle(out: Path, action: str) -> tuple[str, bool | None]:
    """The Lightning callback in the lifecycle scenario (as `hf_lifecycle`)."""
    import lightning.pytorch as pl

    from msprobe_integrations.lightning import MonitorCallback
    from tests.lifecycle_helpers import BAD_STEP, MICRO, STEPS, config, letters, record

    class Recorded(MonitorCallback):
        def on_train_start(self, trainer, pl_module):
            super().on_train_start(trainer, pl_module)
            self._calls = record(self.monitor.monitor)

    weights = _WeightsAt(BAD_STEP)

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % MICRO == 0:
                weights.before(trainer.global_step, pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx % MICRO == MICRO - 1:
                weights.after(trainer.global_step - 1, pl_module)

    callback, _ = lightning_run(out, config(out, action), faults={BAD_STEP}, callback_type=Recorded,
                                callbacks=[Watch()], max_steps=STEPS, accumulate_grad_batches=MICRO,
                                rows=STEPS * MICRO * MICRO_BATCH)
    return letters(callback._calls), weights.unchanged


class _WeightsAt:
    """Whether optimizer step `step` changed the model's weights (None: it did not run)."""

    def __init__(self, step: int) -> None:
        self.step, self.unchanged = step, None
        self._before: list[torch.Tensor] | None = None

    def before(self, step: int, model: torch.nn.Module) -> None:
        if step == self.step:
            self._before = [p.detach().clone() for p in model.parameters()]

    def after(self, step: int, model: torch.nn.Module) -> None:
        if step == self.step and self._before is not None:
            self.unchanged = all(torch.equal(b, p) for b, p in zip(self._before, model.parameters()))
