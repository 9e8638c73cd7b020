"""Every integration makes the lifecycle calls of `msprobe_engine.contract` in the same order.

The same scenario runs under each integration (see `lifecycle_helpers`): 3 optimizer steps
of 2 micro-batches, a nan at step 1 that a `skip` rule catches, and a run whose `stop` rule
fires at step 1. The recorded calls must read, per step: two micro-batches (a begin and
their tensors), the decision before the optimizer step, the step, its end; a skipped step
still reports that the optimizer step ran (as a no-op) and leaves the weights unchanged; a
stop ends at the decision and goes straight to `close`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.lifecycle_helpers import BAD_STEP, MICRO, SKIP_RUN, STEPS, STOP_RUN, config, letters, record
from tests.multiproc import run_ranks


def _nan_after(module: Any, active: dict) -> Any:
    """`module`'s output is multiplied by nan while `active["on"]` (registered before the monitor)."""
    return module.register_forward_hook(lambda mod, args, out: out * float("nan") if active["on"] else None)


def torch_run(out: Path, action: str) -> tuple[str, bool | None]:
    import torch
    from torch import nn

    from msprobe_engine import TrainingStopped
    from msprobe_integrations.torch import TorchMonitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    poison = {"on": False}
    _nan_after(model[1], poison)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TorchMonitor(model, opt, config(out, action))
    calls = record(monitor.monitor)
    unchanged = None
    try:
        for step in range(STEPS):
            poison["on"] = step == BAD_STEP
            before = [p.detach().clone() for p in model.parameters()]
            for _ in range(MICRO):
                loss = model(torch.randn(3, 4)).pow(2).mean()
                loss.backward()
            opt.step()
            opt.zero_grad()
            monitor.step_end(loss.detach())
            if step == BAD_STEP:
                unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    except TrainingStopped:
        pass
    monitor.close()
    return letters(calls), unchanged


def deepspeed_run(rank: int, world: int, out: str, action: str) -> tuple[str, bool | None]:
    import deepspeed
    import torch
    from torch import nn

    from examples.deepspeed_train import init_distributed
    from msprobe_engine import TrainingStopped
    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    poison = {"on": False}
    _nan_after(model[1], poison)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config={"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": MICRO,
                "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 6})
    monitor = DeepSpeedMonitor(engine, config(Path(out), action))
    calls = record(monitor.monitor)
    unchanged = None
    try:
        for step in range(STEPS):
            poison["on"] = step == BAD_STEP
            before = [p.detach().clone() for p in engine.module.parameters()]
            for _ in range(MICRO):
                loss = engine(torch.randn(3, 4)).pow(2).mean()
                engine.backward(loss)
                engine.step()
            if step == BAD_STEP:
                unchanged = all(torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
    except TrainingStopped:
        pass
    monitor.close()
    return letters(calls), unchanged


def megatron_run(rank: int, world: int, out: str, action: str) -> tuple[str, bool | None]:
    from tests import megatron_helpers as H
    from msprobe_engine import TrainingStopped
    from msprobe_integrations.megatron import MegatronMonitor

    H.init_parallel()
    H.fresh_rerun_engine()
    model = H.wrap_ddp(H.build_gpt())
    optimizer = H.build_optimizer([model])
    monitor = MegatronMonitor([model], optimizer, config=config(Path(out), action))
    calls = record(monitor.monitor)
    weight = model.module.output_layer.weight
    unchanged = None
    try:
        for step in range(STEPS):
            if step == BAD_STEP:
                H.inject_nan(model, 1)
            before = weight.detach().clone()
            loss, _, _ = H.train_step(model, optimizer, H.micro_batches(H.TinySpec(), MICRO, seed=step))
            monitor.step_end(loss)
            if step == BAD_STEP:
                unchanged = bool((weight == before).all())
    except TrainingStopped:
        pass
    monitor.close()
    return letters(calls), unchanged


def fsdp2_run(rank: int, world: int, out: str, action: str) -> tuple[str, bool | None]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from msprobe_engine import TrainingStopped
    from msprobe_engine.frameworks.torch.fsdp import local_tensor
    from msprobe_integrations.torch import TorchMonitor

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    poison = {"on": False}
    _nan_after(model[1], poison)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TorchMonitor(model, opt, config(Path(out), action))
    calls = record(monitor.monitor)
    unchanged = None
    try:
        for step in range(STEPS):
            poison["on"] = step == BAD_STEP
            before = [local_tensor(p).detach().clone() for p in model.parameters()]
            for _ in range(MICRO):
                model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            monitor.step_end()
            if step == BAD_STEP:
                unchanged = all(torch.equal(b, local_tensor(p)) for b, p in zip(before, model.parameters()))
    except TrainingStopped:
        pass
    monitor.close()
    dist.destroy_process_group()
    return letters(calls), unchanged


def _in_a_rank(fn: Any) -> Any:
    def run(out: Path, action: str) -> tuple[str, bool | None]:
        return run_ranks(fn, 1, str(out), action, timeout=240, env={"DS_ACCELERATOR": "cpu"})[0]
    return run


def _on_two_ranks(fn: Any) -> Any:
    def run(out: Path, action: str) -> tuple[str, bool | None]:
        return run_ranks(fn, 2, str(out), action, timeout=240)[0]
    return run


def mindspore_run(out: Path, action: str) -> tuple[str, bool | None]:
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn

    from msprobe_engine import TrainingStopped
    from msprobe_integrations.mindspore import MindSporeMonitor

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_seed(0)
    poison = {"on": False}

    class Poison(nn.Cell):
        def construct(self, x):
            return x * float("nan") if poison["on"] else x

    net = nn.SequentialCell(nn.Dense(4, 8), nn.Tanh(), Poison(), nn.Dense(8, 2))
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    monitor = MindSporeMonitor(net, opt, config(out, action))
    calls = record(monitor.monitor)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, opt.parameters)
    rng = np.random.default_rng(0)
    unchanged = None
    try:
        for step in range(STEPS):
            poison["on"] = step == BAD_STEP
            before = [p.asnumpy().copy() for p in net.trainable_params()]
            grads = None
            for _ in range(MICRO):
                loss, g = grad_fn(Tensor(rng.standard_normal((3, 4)).astype(np.float32)))
                grads = g if grads is None else tuple(a + b for a, b in zip(grads, g))
            opt(grads)
            monitor.step_end(loss)
            if step == BAD_STEP:
                unchanged = all((b == p.asnumpy()).all() for b, p in zip(before, net.trainable_params()))
    except TrainingStopped:
        pass
    monitor.close()
    return letters(calls), unchanged


def _trainer(name: str) -> Any:
    def run(out: Path, action: str) -> tuple[str, bool | None]:
        from tests import trainer_helpers
        return getattr(trainer_helpers, name)(out, action)
    return run


RUNNERS = {"torch": torch_run, "deepspeed": _in_a_rank(deepspeed_run), "megatron": _in_a_rank(megatron_run),
           "fsdp2": _on_two_ranks(fsdp2_run), "mindspore": mindspore_run, "hf": _trainer("hf_lifecycle"),
           "lightning": _trainer("lightning_lifecycle")}


@pytest.mark.slow
@pytest.mark.parametrize("integration", list(RUNNERS))
def test_lifecycle_calls_arrive_in_order(integration, tmp_path):
    run = RUNNERS[integration]
    skipped, unchanged = run(tmp_path / "skip", "skip")
    assert SKIP_RUN.match(skipped), skipped
    assert unchanged, "the skipped step changed the weights"
    stopped, _ = run(tmp_path / "stop", "stop")
    assert STOP_RUN.match(stopped), stopped


def test_the_recorder_sees_a_wrong_order():
    """The patterns reject what an integration must not do."""
    good = "MTMTBTAET" * STEPS + "C"
    assert SKIP_RUN.match(good) and STOP_RUN.match("MTMTBTATE" * BAD_STEP + "MTMTBC")
    for bad in ("MTMTATBTE" * STEPS + "C",    # the optimizer step before the decision
                "MTMTBTEAT" * STEPS + "C",    # the step closed before the optimizer step
                "MTBTATE" * STEPS + "C",      # one micro-batch, not two
                "MTMTBTATE" * STEPS,          # never closed
                "MTMTBTAT" + "MTMTBTATE" * (STEPS - 1) + "C"):  # a step without its end
        assert not SKIP_RUN.match(bad), bad
    assert not STOP_RUN.match("MTMTBTATE" * BAD_STEP + "MTMTBTATEC")  # went on after stop

