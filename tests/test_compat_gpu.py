"""The drop-in on a CUDA device: `save` records without a host synchronisation before `step()`,
and the same numbers as on the CPU; `seed_all(mode=True)` gives bitwise repeatable cuBLAS results.

Needs a GPU: every test is marked `gpu` and skipped without CUDA (no GPU in CI)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from msprobe_engine.compat import PrecisionDebugger, seed_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _saved(tmp_path, device: str) -> dict:
    PrecisionDebugger._forget()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh()).to(device)
    x = torch.randn(8, 16).to(device)
    debugger = PrecisionDebugger(dump_path=str(tmp_path / device), level="debug")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        h = model(x)
        debugger.save(h, "h")
        h.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    debugger.step()
    debugger.close()
    PrecisionDebugger._forget()
    (file,) = (tmp_path / device).rglob("debug.json")
    return json.loads(file.read_text())["data"]


def test_save_on_cuda_syncs_only_at_step_and_matches_the_cpu(tmp_path):
    cuda, cpu = _saved(tmp_path, "cuda"), _saved(tmp_path, "cpu")
    assert list(cuda) == list(cpu) == ["h.0.debug", "h_grad.0.debug"]
    for name in cpu:
        for key in ("Max", "Min", "Mean", "Norm"):
            assert cuda[name][key] == pytest.approx(cpu[name][key], rel=1e-4, abs=1e-6), (name, key)


def test_seed_all_mode_makes_cuda_matmuls_repeatable():
    outs = []
    try:
        for _ in range(2):
            seed_all(5, mode=True)
            a, b = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
            outs.append((a @ b).sum(dim=0).cpu())
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(outs[0], outs[1])
