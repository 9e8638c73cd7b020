"""task grad_probe: the predecessor's per-parameter CSV and direction files, against numpy references."""
from __future__ import annotations

import csv
import hashlib
import json

import numpy as np
import pytest
import torch
from torch import nn

from msprobe_engine.errors import ConfigError
from msprobe_engine.dump import PrecisionDebugger


def _rows(path) -> tuple[list[str], dict[str, list[str]]]:
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    return lines[0], {line[0]: line[1:] for line in lines[1:]}


def _reference(grad: np.ndarray, bounds: list[float]) -> list[float]:
    """The L2 shares of `grad` (float64), computed with numpy's digitize semantics written out."""
    g = grad.astype(np.float64).ravel()
    edges = [-np.inf] + list(bounds) + [np.inf]
    shares = [np.mean((g > lo) & (g <= hi)) if hi != np.inf else np.mean(g > lo) for lo, hi in zip(edges, edges[1:])]
    return shares + [np.mean(g == 0)]


def _probe(tmp_path, model, grads, steps=2, **section):
    """Run `steps` optimizer steps with the given gradients set by hand (lr 0: weights stay)."""
    config = {"task": "grad_probe", "dump_path": str(tmp_path), "strict": True, "grad_probe": section}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with PrecisionDebugger(config) as debugger:
        debugger.monitor(model)
        for step in range(steps):
            for name, p in model.named_parameters():
                p.grad = grads(step, name, p)
            opt.step()
    return debugger


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_columns_match_numpy_with_values_on_the_bounds(tmp_path, dtype):
    bounds = [-1, 0, 0.5, 1]
    edge = torch.tensor([-1.0, 0.0, 0.5, 1.0, -2.0, 3.0, 0.25, -0.5, 0.0, 1e-30, -1e-30, 0.5000001]).to(dtype)
    model = nn.Linear(3, 4).to(dtype)
    grads = {"weight": edge.reshape(4, 3), "bias": torch.tensor([0.1, -0.1, 2.0, 0.0]).to(dtype)}
    _probe(tmp_path, model, lambda s, n, p: grads[n] * (s + 1), bounds=bounds, grad_level="L2")
    head, rows = _rows(tmp_path / "rank0" / "grad_summary_0.csv")
    assert head == ["param_name", "(-inf, -1]", "(-1, 0]", "(0, 0.5]", "(0.5, 1]", "(1, inf)", "=0",
                    "max", "min", "norm", "shape"]
    for name, g in grads.items():
        row = rows[name]
        g = g.float()  # numpy has no bfloat16; the values are exact in float32
        np.testing.assert_allclose([float(v) for v in row[:6]], _reference(g.numpy(), bounds), rtol=0, atol=1e-12)
        ref = g.numpy().astype(np.float64)
        assert float(row[6]) == ref.max() and float(row[7]) == ref.min()
        np.testing.assert_allclose(float(row[8]), np.sqrt((ref ** 2).sum()), rtol=1e-7)
        assert json.loads(row[9]) == list(g.shape)
        np.testing.assert_array_equal(np.load(tmp_path / "rank0" / "step0" / f"{name}.npy"), g.numpy() > 0)
    _, second = _rows(tmp_path / "rank0" / "grad_summary_1.csv")  # step 1: the gradients doubled
    assert float(second["bias"][6]) == 4.0


def test_l0_md5_and_bf16_gradients(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 8).to(torch.bfloat16)
    fixed = {n: torch.randn(p.shape).to(torch.bfloat16) for n, p in model.named_parameters()}
    _probe(tmp_path, model, lambda s, n, p: fixed[n].clone(), steps=1, grad_level="L0")
    head, rows = _rows(tmp_path / "rank0" / "grad_summary_0.csv")
    assert head == ["param_name", "MD5", "max", "min", "norm", "shape"]
    for name, g in fixed.items():
        ref = g.float().numpy()
        md5, high, low, norm, _ = rows[name]
        assert md5 == hashlib.md5(ref.tobytes()).hexdigest()
        assert (float(high), float(low)) == (ref.max(), ref.min())
        np.testing.assert_allclose(float(norm), np.sqrt((ref.astype(np.float64) ** 2).sum()), rtol=1e-6)
    assert not (tmp_path / "rank0" / "step0").exists()  # L0 has no direction files


def test_param_list_and_steps_select(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    debugger = _probe(tmp_path, model, lambda s, n, p: torch.ones_like(p), steps=3, param_list=["1.weight"])
    assert debugger.transfers == 3
    _, rows = _rows(tmp_path / "rank0" / "grad_summary_2.csv")
    assert list(rows) == ["1.weight"] and rows["1.weight"][:2] == ["1.0", "1.0"]
    assert sorted(p.name for p in (tmp_path / "rank0" / "step2").iterdir()) == ["1.weight.npy"]


@pytest.mark.parametrize("section,message", [
    ({"grad_level": "L3"}, "grad_probe.grad_level: 'L3' is not one of L0, L1, L2"),
    ({"bounds": [0, 0]}, "grad_probe.bounds[1]: 0 is not greater than bounds[0] = 0"),
    ({"bounds": [1, 2 ** 63]}, "grad_probe.bounds[1]: 9223372036854775808 is outside the int64 range"),
    ({"bounds": []}, "grad_probe.bounds: expected a non-empty ascending list"),
    ({"param_list": "w"}, "grad_probe.param_list: expected a list of parameter names"),
    ({"grad_levels": "L1"}, "grad_probe.grad_levels: unknown key (did you mean 'grad_level'?)"),
])
def test_bad_grad_probe_config(tmp_path, section, message):
    with pytest.raises(ConfigError) as err:
        PrecisionDebugger({"task": "grad_probe", "dump_path": str(tmp_path), "grad_probe": section})
    assert message in str(err.value)


def test_unknown_parameter_is_named_before_training(tmp_path):
    debugger = PrecisionDebugger({"task": "grad_probe", "dump_path": str(tmp_path),
                                  "grad_probe": {"param_list": ["0.weigth"]}})
    with pytest.raises(ConfigError, match=r"param_list\[0\]: the model has no trainable parameter '0.weigth' "
                                          r"\(did you mean '0.weight'\?\)"):
        debugger.monitor(nn.Sequential(nn.Linear(2, 2)))
    debugger.close()


def _directions_run(root, seed, steps=3, flip=None):
    """A grad_probe run whose gradients are fixed random signs; `flip`: (step, share) flips that share."""
    gen = torch.Generator().manual_seed(seed)
    base = {"0.weight": torch.randn(20, 10, generator=gen), "0.bias": torch.randn(20, generator=gen)}
    model = nn.Sequential(nn.Linear(10, 20))

    def grads(step, name, p):
        g = base[name].clone()
        if flip is not None and step >= flip[0]:
            n = int(g.numel() * flip[1])
            g.view(-1)[:n] *= -1
        return g
    _probe(root, model, grads, steps=steps, grad_level="L1")


def test_compare_verb_between_runs_flags_a_drop(tmp_path):
    from msprobe_engine.cli import main

    _directions_run(tmp_path / "a", seed=1)
    _directions_run(tmp_path / "b", seed=1, flip=(2, 0.1))
    out = tmp_path / "out"
    assert main(["grad-probe", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out),
                 "--json", str(tmp_path / "sim.json")]) == 0
    result = json.loads((tmp_path / "sim.json").read_text())[0]
    assert result["steps"] == [0, 1, 2]
    weight = result["similarities"]["0.weight"]
    assert weight[:2] == [1.0, 1.0] and weight[2] == pytest.approx(0.9)
    assert result["similarities"]["summary"][2] == pytest.approx((200 - 20 + 20 - 2) / 220)
    assert any("0.weight: similarity dropped 0.1000 from step 1 to step 2" in p for p in result["problems"])
    with open(out / "rank0" / "similarities.csv", newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == ["step", "0", "1", "2"] and [line[0] for line in lines[1:]] == ["0.weight", "0.bias", "summary"]
    for png in (out / "rank0" / "similarities.png", out / "rank0" / "similarities_picture" / "0.weight_similarities.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_steps_of_one_run_and_low_first_step(tmp_path):
    from msprobe_engine.analysis.grad_probe import compare_runs, compare_steps

    _directions_run(tmp_path / "a", seed=1, flip=(1, 0.5))
    steps = compare_steps(tmp_path / "a")[0]
    assert steps.steps == [1, 2] and steps.by_param["0.weight"] == [pytest.approx(0.5), 1.0]
    _directions_run(tmp_path / "c", seed=2)  # other random signs: about half agree from step 0
    runs = compare_runs(tmp_path / "a", tmp_path / "c")[0]
    assert any("is below 0.97" in p and "summary" in p for p in runs.problems)
