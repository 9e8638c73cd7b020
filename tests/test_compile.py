"""The monitor inside `torch.compile` (inductor, CPU): no graph break, no recompilation caused by
the monitor, statistics measured in the graph that change every step and equal eager's, losses
bitwise equal to the compiled run without the monitor, and incidents that name eager's culprit
for a forward and a backward fault."""
import dataclasses

import numpy as np
import pytest
import torch
import torch._dynamo
from torch import nn

from incident_helpers import config as incident_config
from incident_helpers import gpt_and_adam, inject_backward, read_incident, run as run_incident_steps
from examples.tiny_gpt import inject
from msprobe_engine.config import load_config
from msprobe_engine.frameworks.torch import cpu_reduce, opaque_row
from msprobe_engine.frameworks.torch.compiled_hooks import clean_path, compiled_parts
from msprobe_integrations.torch import TorchMonitor

EVERYTHING = {"strict": True, "sinks": [], "incidents": {"enabled": False},
              "watch": {"module_outputs": True, "module_inputs": True, "activation_grads": True,
                        "param_grads": True, "params": True,
                        "optimizer_state": ["exp_avg", "exp_avg_sq", "update", "ratio"]},
              "stats": ["min", "max", "mean", "norm", "nan_count", "inf_count", "zero_frac"]}


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Net(nn.Module):
    """The issue's model, smaller: residual MLP blocks and a scalar loss."""

    def __init__(self, dim: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def counts() -> tuple[int, int]:
    c = torch._dynamo.utils.counters
    return sum(c["graph_break"].values()), c["stats"]["unique_graphs"]


def train(config, steps: int, compiled: bool = True, attach_compiled: bool = False, fullgraph: bool = True):
    """Losses, the monitor (or None) and (graph breaks, graphs) of `steps` steps of a fresh Net."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward = torch.compile(model, fullgraph=fullgraph) if compiled else model
    monitor = None
    if config is not None:
        monitor = TorchMonitor(forward if attach_compiled else model, opt, config)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=data)
        opt.zero_grad(set_to_none=True)
        loss = forward(x)
        loss.backward()
        opt.step()
        if monitor is not None:
            monitor.step_end(loss)
        losses.append(loss.detach())
    if monitor is not None:
        monitor.close()
    return torch.stack(losses), monitor, counts()


def shipped(name: str, tmp_path):
    config = load_config(None if name == "default" else f"configs/{name}.yaml")
    return dataclasses.replace(config, output_dir=str(tmp_path), strict=True)


@pytest.mark.parametrize("opaque", [False, True], ids=["fused", "opaque_row"])
def test_statistics_in_the_graph_change_every_step_and_equal_eager(tmp_path, monkeypatch, opaque):
    """`opaque_row`: every row in the graph (activations and their gradients) measured by the C kernel's
    op (`msprobe::cpu_row`), not by a reduction inductor fuses."""
    if opaque:
        if not cpu_reduce.available():
            pytest.skip(f"the C kernel is off: {cpu_reduce.disabled_reason}")
        monkeypatch.setattr(opaque_row, "MIN_NUMEL", 1)
    single = []  # the kernel's calls for one tensor (the op's, and the eager path's) in the compiled run
    kernel_rows, kernel_row = cpu_reduce.rows, cpu_reduce.row
    monkeypatch.setattr(cpu_reduce, "rows", lambda ts, zeros=False: single.append(len(ts) == 1) or kernel_rows(ts, zeros))
    monkeypatch.setattr(cpu_reduce, "row", lambda t, zeros=False: single.append(True) or kernel_row(t, zeros))
    compiled_losses, monitor, (breaks, graphs) = train({**EVERYTHING, "output_dir": str(tmp_path / "c")}, 3)
    grad_rows = sum(t.startswith("actv_grad/") and t.endswith("/norm") for t in monitor.history[0].metrics)
    # at every step, for most gradient rows (a residual's equal gradients share one call)
    assert sum(single) >= 3 * grad_rows // 2 if opaque else sum(single) < grad_rows
    assert (breaks, graphs) == (0, 1)
    _, eager, _ = train({**EVERYTHING, "output_dir": str(tmp_path / "e")}, 3, compiled=False)
    plain, _, _ = train(None, 3)
    assert torch.equal(compiled_losses, plain)  # bitwise: the monitor changes nothing in the compiled step
    got, want = list(monitor.history), list(eager.history)
    assert [r.step for r in got] == [0, 1, 2]
    assert [r.micro_steps for r in got] == [1, 1, 1]  # the root's pre-hook runs eagerly (`never_a_frame`)
    for kind in ("actv/blocks.0.fc1/output", "actv/blocks.1.norm/input.0", "actv_grad/blocks.1.fc2/output"):
        norms = [r.metrics[f"{kind}/norm"] for r in got]
        assert len(set(norms)) == 3, (kind, norms)  # measured at run time, not once at trace time
    # step 0: the same weights and data; inductor's fused reductions (float32) within 1e-4 relative,
    # a mean near zero within 1e-6 of its tensor's norm
    tags = [t for t in want[0].metrics if t.startswith(("actv", "grad", "param", "optim"))]
    assert len(tags) > 100 and set(tags) <= set(got[0].metrics)
    for tag in tags:
        a, b = got[0].metrics[tag], want[0].metrics[tag]
        scale = want[0].metrics.get(tag.rsplit("/", 1)[0] + "/norm", abs(b))
        assert np.isclose(a, b, rtol=1e-4, atol=1e-6 * scale, equal_nan=True), (tag, a, b)


def test_a_compiled_wrapper_given_to_the_monitor_keeps_the_module_names_and_counts_micro_steps(tmp_path):
    _, monitor, (breaks, graphs) = train({**EVERYTHING, "output_dir": str(tmp_path)}, 2, attach_compiled=True)
    assert (breaks, graphs) == (0, 1)
    metrics = monitor.history[-1].metrics
    assert "actv/blocks.0.fc1/output/norm" in metrics and "grad/blocks.0.fc1.weight/norm" in metrics
    assert not [t for t in metrics if "_orig_mod" in t]
    assert [r.micro_steps for r in monitor.history] == [1, 1]


def test_a_model_compiled_after_attach_counts_micro_steps_in_the_graph(tmp_path):
    """The root's pre-hook inlined into a larger compiled module (nn.Sequential is inlined) counts
    at run time through `RunTimeCall`; compiled as the root, it runs eagerly (the statistics test)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = nn.Sequential(Net(), nn.Identity())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TorchMonitor(model, opt, {**EVERYTHING, "output_dir": str(tmp_path / "seq")})
    forward = torch.compile(model, fullgraph=True)
    for micro_steps in (2, 3):
        for _ in range(micro_steps):
            forward(torch.randn(8, 16)).backward()
        opt.step()
        opt.zero_grad()
        monitor.step_end()
    monitor.close()
    assert counts() == (0, 1)
    assert [r.micro_steps for r in monitor.history] == [2, 3]


def test_a_schedule_that_skips_steps_uses_two_graphs(tmp_path):
    config = {**EVERYTHING, "output_dir": str(tmp_path), "schedule": {"interval": 2}}
    losses, monitor, (breaks, graphs) = train(config, 6)
    assert (breaks, graphs) == (0, 2)  # monitored and unmonitored, nothing recompiled after that
    assert [r.step for r in monitor.history] == [0, 2, 4]
    assert torch.equal(losses, train(None, 6)[0])


@pytest.mark.parametrize("name", ["minimal", pytest.param("grads_optimizer", marks=pytest.mark.slow),
                                  pytest.param("full", marks=pytest.mark.slow),
                                  pytest.param("default", marks=pytest.mark.slow)])
def test_every_shipped_config_compiles_with_fullgraph_and_no_recompilation(tmp_path, name):
    losses, monitor, (breaks, graphs) = train(shipped(name, tmp_path), 4)
    assert (breaks, graphs) == (0, 1)
    assert torch.equal(losses, train(None, 4)[0])
    assert len(monitor.history) == 4 and "grad/blocks.0.fc1.weight/norm" in monitor.history[-1].metrics


def test_a_monitor_attached_after_the_first_compiled_call_says_that_its_hooks_do_not_run(tmp_path, caplog):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward = torch.compile(model, fullgraph=True)
    forward(torch.randn(8, 16)).backward()  # compiled (and cached) without the hooks
    monitor = TorchMonitor(model, opt, {**EVERYTHING, "output_dir": str(tmp_path), "strict": False})
    with caplog.at_level("WARNING", logger="msprobe_engine"):
        for _ in range(2):
            opt.zero_grad()
            loss = forward(torch.randn(8, 16))
            loss.backward()
            opt.step()
            monitor.step_end(loss)
    monitor.close()
    assert "actv/blocks.0.fc1/output/norm" not in monitor.history[-1].metrics
    assert sum("keeps the graph it compiled without the hooks" in r.message for r in caplog.records) == 1


def test_names_of_compiled_parts():
    model = Net()
    model.blocks[0] = torch.compile(model.blocks[0])
    assert compiled_parts(model) and not compiled_parts(Net())
    assert clean_path("blocks.0._orig_mod.fc1.weight") == "blocks.0.fc1.weight"
    assert clean_path("_orig_mod.head") == "head"


def culprit(tmp_path, step: int) -> dict:
    return read_incident(tmp_path / "incidents" / f"step{step}-rank0-non_finite")["culprit"]


@pytest.mark.slow
@pytest.mark.parametrize("phase, layer", [("forward", "layers.1.mlp.0"), ("backward", "layers.1.mlp.2")])
def test_an_injected_nan_names_the_same_culprit_as_eager(tmp_path, phase, layer):
    """A backward fault under compile: the step's rows note no call graph, so the culprit is
    searched in the eager replay's rows (`"from": "replay"`)."""
    named = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        model, opt = gpt_and_adam()
        monitor = None
        if phase == "forward":
            inject(model, layer, lambda: monitor.step, 2, "nan", traced=True)
        else:
            inject_backward(model, layer, lambda: monitor.step, 2, "nan", "function", traced=True)
        out = tmp_path / mode
        monitor = TorchMonitor(model, opt, incident_config(out, watch={"activation_grads": True}))
        if mode == "compiled":
            torch._dynamo.utils.counters.clear()
            model.forward = torch.compile(model.forward)
        # the fault hooks compare the step as a tensor in the graph (`traced`): no guard on a Python
        # step, so the forward compiles once (the eager replay of step 2 recompiles nothing)
        run_incident_steps(model, opt, monitor, 3)
        monitor.close()
        if mode == "compiled":
            assert counts()[1] == 1  # one graph: the fault's gate recompiles nothing
        found = culprit(out, 2)
        named[mode] = (found["phase"], found["call"], found.get("from"))
        if phase == "forward":
            assert found["first_bad"].startswith(f"actv/{layer}/output")
        else:
            assert found["dump_entry"] == f"Module.{layer}.Linear.backward.0"
    assert named["eager"] == (phase, layer, None)
    assert named["compiled"][:2] == (phase, layer)
    if phase == "backward":
        assert named["compiled"][2] == "replay"


def test_a_compiled_optimizer_step_runs_the_monitors_hooks_eagerly(tmp_path):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TorchMonitor(model, opt, {**EVERYTHING, "output_dir": str(tmp_path)})
    step = torch.compile(opt.step)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(torch.randn(8, 16))
        loss.backward()
        step()
        monitor.step_end(loss)
    monitor.close()
    breaks, graphs = counts()
    assert breaks <= 2 and graphs == 1  # the hooks' breaks at the step's start and end; the step's math is one graph
    history = list(monitor.history)
    assert [r.step for r in history] == [0, 1, 2]
    for tag in ("grad/head.weight/norm", "optim/head.weight/exp_avg/norm", "optim/head.weight/update/norm"):
        assert len({r.metrics[tag] for r in history}) == 3, tag


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: compile with inductor's GPU "
                    "kernels (triton) and the buffer on the device")
def test_compiled_on_a_device(tmp_path):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TorchMonitor(model, opt, {**EVERYTHING, "output_dir": str(tmp_path)})
    forward = torch.compile(model, fullgraph=True)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = forward(torch.randn(8, 16, device="cuda"))
        loss.backward()
        opt.step()
        monitor.step_end(loss)
    monitor.close()
    assert counts() == (0, 1)
    norms = [r.metrics["actv/blocks.0.fc1/output/norm"] for r in monitor.history]
    assert len(set(norms)) == 3 and monitor.host_syncs <= 3
