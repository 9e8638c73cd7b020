"""task free_benchmark: perturbed reruns report an unstable API, change nothing in check mode, fix in fix mode."""
from __future__ import annotations

import csv
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from msprobe_engine.cli import main
from msprobe_engine.errors import ConfigError
from msprobe_engine.dump import PrecisionDebugger, find_rank_dirs
from msprobe_engine.dump.free_benchmark_files import RESULT_CSV


class Spread(nn.Module):
    """relu (stable) and the variance of values far from their mean (ill-conditioned)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc(x)))
        shifted = torch.add(h, 1e4)
        return torch.var(shifted, dim=-1).mean() + h.mean()


def _config(tmp_path, **section):
    return {"task": "free_benchmark", "dump_path": str(tmp_path), "strict": True, "free_benchmark": section}


def _train(steps, debugger=None):
    torch.manual_seed(0)
    model, x = Spread(), torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        if debugger is not None:
            debugger.start(model)
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
        if debugger is not None:
            debugger.stop()
            debugger.step()
    return losses, [p.detach().clone() for p in model.parameters()]


def _results(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_unstable_api_is_reported_stable_ones_pass_and_training_is_bitwise_unchanged(tmp_path):
    plain_losses, plain_params = _train(2)
    debugger = PrecisionDebugger(_config(tmp_path, pert_mode="bit_noise"))
    losses, params = _train(2, debugger)
    debugger.close()
    assert all(torch.equal(a, b) for a, b in zip(losses + params, plain_losses + plain_params))  # dropout too
    rows = _results(find_rank_dirs(tmp_path / "step0")[0] / RESULT_CSV)
    assert list(rows[0]) == ["rank", "pert_mode", "stage", "step", "api_name", "max_rel", "dtype", "shape",
                             "output_index"]
    names = {r["api_name"] for r in rows}
    assert "Torch.var.0.forward" in names
    assert not names & {"Torch.relu.0.forward", "Torch.add.0.forward", "Functional.linear.0.forward",
                         "Functional.dropout.0.forward"}  # dropout reruns with the same random mask
    var = next(r for r in rows if r["api_name"] == "Torch.var.0.forward")
    assert (var["pert_mode"], var["stage"], var["step"], var["dtype"], var["shape"]) == \
        ("bit_noise", "forward", "0", "torch.float32", "torch.Size([8])")
    assert float(var["max_rel"]) > 2e-4
    assert debugger._recorder.compared >= 8 and debugger.transfers == 2  # ratios: one host copy per step
    assert main(["free-benchmark", str(tmp_path), "--json", str(tmp_path / "fb.json")]) == 0
    report = json.loads((tmp_path / "fb.json").read_text())
    assert report[0]["api"] == "Torch.var" and report[0]["steps"] == [0, 1]
    assert report[0]["worst_max_rel"] == max(float(r["max_rel"]) for r in rows + _results(
        find_rank_dirs(tmp_path / "step1")[0] / RESULT_CSV) if r["api_name"].startswith("Torch.var"))


def test_backward_stage_compares_input_gradients(tmp_path):
    plain = _train(1)
    debugger = PrecisionDebugger(_config(tmp_path, pert_mode="bit_noise", fuzz_stage="backward"))
    checked = _train(1, debugger)
    debugger.close()
    assert all(torch.equal(a, b) for a, b in zip(sum(checked, []), sum(plain, [])))  # bitwise unchanged
    failed = {(r.api_name, r.stage) for r in debugger.task_results}
    assert ("Torch.var.0.backward", "backward") in failed
    assert not any(name.startswith("Torch.relu") for name, _ in failed)


class Gains(nn.Module):
    """float16: the product of gains (300, 300, 1/300, 1/300, 2) overflows in float16 on the way."""

    def __init__(self) -> None:
        super().__init__()
        self.gains = nn.Parameter(torch.tensor([300.0, 300.0, 1 / 300, 1 / 300, 2.0]))
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc(x).squeeze(-1) * torch.prod(self.gains), torch.ones(x.shape[0], dtype=x.dtype))


def test_fix_mode_restores_a_loss_a_low_precision_api_broke(tmp_path):
    torch.manual_seed(0)
    reference, x = Gains(), torch.randn(6, 4)
    expected = reference(x)
    half, xh = Gains().half(), x.half()
    half.load_state_dict({k: v.half() for k, v in reference.state_dict().items()})
    assert not torch.isfinite(half(xh))  # broken: prod overflows in float16
    with PrecisionDebugger(_config(tmp_path, handler_type="fix", list=["prod"])) as debugger:
        with debugger.step_scope(half):
            fixed = half(xh)
            fixed.backward()
    assert fixed.dtype == torch.float16 and torch.isfinite(fixed)
    assert fixed.float().item() == pytest.approx(expected.item(), rel=1e-2)
    assert torch.isfinite(half.gains.grad).all()  # gradients flow through the substituted output


@pytest.mark.parametrize("section,message", [
    ({"pert_mode": "noise"}, "free_benchmark.pert_mode: 'noise' is not one of improve_precision"),
    ({"handler_type": "fix", "pert_mode": "add_noise"}, "free_benchmark.pert_mode: 'add_noise' cannot fix outputs"),
    ({"handler_type": "fix", "fuzz_stage": "backward"}, "free_benchmark.fuzz_stage: handler_type \"fix\" substitutes"),
    ({"pert_mode": "to_cpu"}, "free_benchmark.fuzz_device: 'npu' with pert_mode 'to_cpu'"),
    ({"preheat_step": 3}, "free_benchmark.preheat_step/max_sample: need \"if_preheat\": true"),
    ({"max_sampel": 3}, "free_benchmark.max_sampel: unknown key (did you mean 'max_sample'?)"),
])
def test_bad_free_benchmark_config(tmp_path, section, message):
    with pytest.raises(ConfigError) as err:
        PrecisionDebugger(_config(tmp_path, **section))
    assert message in str(err.value)


def test_level_other_than_l1_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="level: 'L0' is not supported by task free_benchmark; use one of L1"):
        PrecisionDebugger({**_config(tmp_path), "level": "L0"})


def test_perturbations_against_explicit_references():
    from msprobe_engine.frameworks.torch.capture.free_benchmark import perturb

    x = torch.tensor([[1.0, -2.0], [1e-5, 4.0]])
    (noisy,), _ = perturb("add_noise", (x,), {}, 0)
    assert torch.equal(noisy, torch.where(x.abs() > 1e-4, x + 1e-8, x))  # 1e-8 is lost next to 1.0 in float32
    (flipped,), _ = perturb("bit_noise", (x,), {}, 0)
    assert torch.equal(flipped.view(torch.int32), x.view(torch.int32) ^ 1)
    (swapped,), _ = perturb("change_value", (x,), {}, 0)
    assert torch.equal(swapped, torch.tensor([[4.0, -2.0], [1e-5, 1.0]])) and x[0, 0] == 1.0  # the input untouched
    args, kwargs = perturb("improve_precision", (x.half(), 3), {"other": x.bfloat16()}, 0)
    assert (args[0].dtype, args[1], kwargs["other"].dtype) == (torch.float32, 3, torch.float32)
    (same,), _ = perturb("no_change", (x,), {}, 0)
    assert same is x


def test_preheat_raises_each_apis_threshold_to_the_sampled_ratios(tmp_path):
    torch.manual_seed(0)
    model, x = Spread().eval(), torch.randn(8, 16)  # eval: the same ratios every step
    section = {"pert_mode": "bit_noise", "if_preheat": True, "preheat_step": 1, "max_sample": 5}
    with PrecisionDebugger(_config(tmp_path, **section)) as debugger:
        for _ in range(2):
            with debugger.step_scope(model):
                model(x)
    assert debugger.task_results == [] and debugger._recorder.compared > 0  # step 0 sampled, step 1 passed
    plain = PrecisionDebugger(_config(tmp_path / "plain", pert_mode="bit_noise"))
    with plain.step_scope(model):
        model(x)
    plain.close()
    assert any(r.api_name == "Torch.var.0.forward" for r in plain.task_results)  # without preheat: reported
