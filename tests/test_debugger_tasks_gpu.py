"""The debugger tasks on a CUDA device: no host synchronisation inside a step, results on the device.

Needs a GPU: every test is marked `gpu` and skipped without CUDA (no GPU in CI)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from msprobe_engine.dump import PrecisionDebugger, load_dump

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@contextlib.contextmanager
def no_host_sync():
    """Any device-to-host synchronisation inside raises (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1)).cuda(), torch.randn(8, 16, device="cuda")


@pytest.mark.parametrize("config", [
    {"task": "overflow_check", "overflow_check": {"overflow_nums": -1}},
    {"task": "free_benchmark", "free_benchmark": {"pert_mode": "add_noise"}},
    {"task": "statistics", "summary_mode": "xor"},
])
def test_a_step_makes_no_host_sync_until_it_ends(tmp_path, config):
    model, x = _model()
    with PrecisionDebugger({"dump_path": str(tmp_path), "level": "L1", "strict": True, **config}) as debugger:
        debugger.start(model)
        with no_host_sync():
            model(x).sum().backward()
        debugger.stop()
        debugger.step()  # the one read of the step's flags/ratios/checksums


def test_overflow_on_the_device_is_found_and_its_tensors_saved(tmp_path):
    model, x = _model()
    with torch.no_grad():
        model[2].bias.fill_(float("nan"))
    with PrecisionDebugger({"task": "overflow_check", "dump_path": str(tmp_path), "strict": True}) as debugger:
        with debugger.step_scope(model):
            model(x).sum().backward()
    rank = load_dump(tmp_path)[(0, None)]
    assert list(rank.data) == ["Functional.linear.1.forward"]
    saved = torch.load(rank.path / "dump_tensor_data" / rank.data["Functional.linear.1.forward"]["output"][0]["data_name"])
    assert saved.device.type == "cpu" and torch.isnan(saved).all()


def test_xor_checksums_on_the_device_equal_the_cpu_ones(tmp_path):
    from msprobe_engine.frameworks.torch.capture.checksum import fold, xor_words

    t = torch.randn(1000, 33)
    assert fold(xor_words(t.cuda()).cpu().numpy()) == fold(xor_words(t).numpy())


def test_to_cpu_fix_mode_returns_device_tensors_and_keeps_gradients(tmp_path):
    model, x = _model()
    with PrecisionDebugger({"task": "free_benchmark", "dump_path": str(tmp_path), "strict": True,
                            "free_benchmark": {"pert_mode": "to_cpu", "fuzz_device": "cpu", "handler_type": "fix"}}) as d:
        with d.step_scope(model):
            out = model(x)
            out.sum().backward()
    assert out.device.type == "cuda" and model[0].weight.grad.device.type == "cuda"
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)  # the CPU result, cast back to the device
