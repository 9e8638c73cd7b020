"""The fused Triton reduction kernel (msprobe_engine/frameworks/torch/fused_reduce.py).

Without a GPU the kernel runs for real in Triton's interpreter (TRITON_INTERPRET=1, which must
be set before Triton is imported: so in a subprocess, tests/fused_reduce_cases.py) on CPU tensors,
and compiles ahead of time for CUDA targets (ptxas ships with Triton). With a CUDA device the
`gpu` tests run it compiled and compare it with the CPU path. Its selection, switch and fallback
are tested here without Triton.
"""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from msprobe_engine.frameworks.torch import backend, cpu_reduce, fused_reduce

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "fused_reduce_cases.py"


def run_script(args, env=None, timeout=300):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None: unset
    proc = subprocess.run([sys.executable, *args], env=full_env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interpreted(quick):
    summary = run_script([str(CASES), *(["--quick"] if quick else [])], env={"TRITON_INTERPRET": "1"})
    assert summary["device"] == "cpu" and summary["n_problems"] == 0, summary
    assert summary["checked_rows"] > 50
    return summary


def test_the_kernel_in_the_interpreter_matches_the_cpu_path_on_a_quick_set_of_cases():
    """fp32/fp16/bf16, 1 to 70k elements (several segments), nan, inf, empty, zero-dim, all zeros,
    signed zeros, non-contiguous and unaligned views, with the zero count; and the backend's hook
    on mixed batches (deferred, concat, pick), against the CPU path and the float64 reference."""
    interpreted(quick=True)


@pytest.mark.slow
def test_the_kernel_in_the_interpreter_matches_the_cpu_path_on_every_case_and_in_a_training_run():
    """Every case one tensor a call and batched, with and without the zero count, up to 300k
    elements; and a monitored training run whose records equal the torch path's (about 30 s)."""
    summary = interpreted(quick=False)
    assert summary["checked_rows"] > 300


AOT = r"""
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from msprobe_engine.frameworks.torch import fused_reduce, fused_reduce_kernels as k
out = {}
for arch in (80, 90):
    target = GPUTarget("cuda", arch, 32)
    for name, dtype in (("fp32", tl.float32), ("fp16", tl.float16), ("bf16", tl.bfloat16)):
        for aligned in (True, False):
            src = ASTSource(k.segment_kernel, {"table": "*i64", "n_tensors": "i32", "search_steps": "i32",
                                               "partials": "*fp64", "SEGMENT": "constexpr",
                                               "DTYPE": "constexpr", "BLOCK": "constexpr", "ALIGNED": "constexpr"},
                            constexprs={"DTYPE": dtype, "SEGMENT": fused_reduce.SEGMENT, "BLOCK": fused_reduce.BLOCK,
                                        "ALIGNED": aligned})
            c = triton.compile(src, target=target, options={"num_warps": 4, "enable_fp_fusion": True})
            loads = sorted({w for line in c.asm["ptx"].splitlines() for w in line.split() if w.startswith("ld.global")})
            out[f"sm{arch} {name} aligned={aligned}"] = {"cubin": len(c.asm["cubin"]), "loads": loads}
    for zeros in (True, False):
        src = ASTSource(k.combine_kernel, {"partials": "*fp64", "starts": "*i64", "rows": "*fp64",
                                           "COUNT_ZEROS": "constexpr", "BLOCK": "constexpr"},
                        constexprs={"COUNT_ZEROS": zeros, "BLOCK": fused_reduce.COMBINE_BLOCK})
        c = triton.compile(src, target=target, options={"num_warps": 4, "enable_fp_fusion": True})
        out[f"sm{arch} combine zeros={zeros}"] = {"cubin": len(c.asm["cubin"]), "loads": []}
print(json.dumps(out))
"""


def test_the_kernels_compile_for_cuda_targets_without_a_gpu(tmp_path):
    """Both kernels, every dtype, through Triton's whole pipeline to sm_80 and sm_90 cubins (ptxas
    ships with Triton; no device needed); with the alignment hint the segment loop's loads are
    128-bit vector loads."""
    pytest.importorskip("triton.backends.nvidia")
    compiled = run_script(["-c", AOT], env={"TRITON_CACHE_DIR": str(tmp_path / "cache")})
    assert len(compiled) == 16 and all(entry["cubin"] > 0 for entry in compiled.values())
    for arch in (80, 90):
        for dtype in ("fp32", "fp16", "bf16"):
            assert "ld.global.v4.b32" in compiled[f"sm{arch} {dtype} aligned=True"]["loads"], compiled


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The backend's hook engaged for CPU tensors (the kernel itself replaced by each test)."""
    monkeypatch.setattr(fused_reduce, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fused_reduce, "ENABLED", True)
    monkeypatch.setattr(fused_reduce, "disabled_reason", None)
    monkeypatch.setattr(fused_reduce, "_kernels", lambda: None)  # "Triton importable"
    return monkeypatch


def tensors():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(100, generator=gen), torch.randn(5000, generator=gen).half(), torch.arange(7),
            torch.randn(3000, generator=gen, dtype=torch.float64), torch.zeros(0)]


def torch_rows(ts, count_zeros=True):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_reduce, "DEVICES", ())
        mp.setattr(cpu_reduce, "ENABLED", False)
        return backend.partial_stats(ts, count_zeros=count_zeros).numpy()


def test_a_kernel_that_fails_is_reported_once_and_the_torch_path_measures_from_then_on(fused_on_cpu, caplog):
    calls = []

    def failing(ts, count_zeros=False):
        calls.append(len(ts))
        raise RuntimeError("no kernel image for this device")

    fused_on_cpu.setattr(fused_reduce, "rows", failing)
    ts = tensors()
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        first = backend.partial_stats(ts, count_zeros=True).numpy()
        second = backend.concat([backend.partial_stats(ts, count_zeros=True, deferred=True)]).numpy()
    np.testing.assert_array_equal(first, torch_rows(ts))
    np.testing.assert_array_equal(second, torch_rows(ts))
    assert calls == [2]  # the float32 group tried once (the float16 one never), then never again
    warnings = [r for r in caplog.records if "fused reduction kernel off" in r.getMessage()]
    assert len(warnings) == 1 and "no kernel image" in warnings[0].getMessage()
    assert fused_reduce.ENABLED is False and "RuntimeError" in fused_reduce.disabled_reason


def test_without_triton_the_torch_path_measures_and_says_so_once(fused_on_cpu, caplog):
    def no_triton():
        raise ImportError("No module named 'triton'")

    fused_on_cpu.setattr(fused_reduce, "_kernels", no_triton)
    ts = tensors()
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        for _ in range(3):
            np.testing.assert_array_equal(backend.partial_stats(ts, count_zeros=True).numpy(), torch_rows(ts))
    assert sum("Triton unavailable" in r.getMessage() for r in caplog.records) == 1
    assert not fused_reduce.available()


def test_the_hook_takes_float32_16_bf16_tensors_of_the_first_device_and_leaves_the_rest(fused_on_cpu):
    seen = []

    def fake_rows(ts, count_zeros=False):  # the torch path's rows, recorded
        seen.append([t.dtype for t in ts])
        return torch.from_numpy(torch_rows(list(ts), count_zeros))

    fused_on_cpu.setattr(fused_reduce, "rows", fake_rows)
    ts = tensors() + [torch.randn(4).bfloat16(), torch.randn(3).to_sparse(), torch.randn(2, dtype=torch.complex64)]
    rows = backend.partial_stats(ts, count_zeros=True).numpy()
    assert seen == [[torch.float32, torch.float32], [torch.float16], [torch.bfloat16]]  # one call per dtype
    want = torch_rows(ts)
    np.testing.assert_allclose(rows, want, rtol=1e-6)  # the same rows, in the input's order
    np.testing.assert_array_equal(np.isnan(rows), np.isnan(want))
    positions, measured = fused_reduce.measure(ts, True)  # reordered by the hook itself: concat needs no reorder
    assert positions == [0, 1, 4, 5]
    np.testing.assert_allclose(measured.numpy(), want[positions], rtol=1e-6)


def test_cpu_tensors_never_reach_the_kernel_by_default(monkeypatch):
    assert fused_reduce.DEVICES == ("cuda",)

    def must_not_run(*args, **kwargs):
        raise AssertionError("the fused kernel was asked to measure CPU tensors")

    monkeypatch.setattr(fused_reduce, "measure", must_not_run)
    backend.partial_stats(tensors(), count_zeros=True)


SWITCH = """
import importlib, json, os, sys
from msprobe_engine.frameworks.torch import backend, fused_reduce as f
import torch
out = [[f.ENABLED, 'triton' in sys.modules]]
for value in ("0", "off", "1"):
    os.environ[f.ENV] = value
    importlib.reload(f)
    f.DEVICES = ('cpu',)
    if value != "1":
        backend.partial_stats([torch.ones(3)])
        out.append([f.ENABLED, f.available(), f.disabled_reason, 'triton' in sys.modules])
    else:
        out.append([f.ENABLED, f.disabled_reason])
print(json.dumps(out))
"""


def test_the_environment_switch_turns_the_kernel_off_and_importing_the_backend_imports_no_triton():
    assert run_script(["-c", SWITCH], env={fused_reduce.ENV: None}) == [
        [True, False],  # the default: on; Triton not imported until a CUDA tensor is measured
        [False, False, f"{fused_reduce.ENV}=0", False], [False, False, f"{fused_reduce.ENV}=off", False],
        [True, None]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_the_compiled_kernel_matches_the_cpu_path_on_every_case_and_in_a_training_run():
    sys.path.insert(0, str(ROOT / "tests"))
    import fused_reduce_cases

    summary = fused_reduce_cases.check("cuda")
    assert summary["n_problems"] == 0, summary
    assert fused_reduce.ENABLED, fused_reduce.disabled_reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_the_kernel_never_synchronises_the_host():
    """`partial_stats` + `concat` of tensors the kernel measures (tables and the reordering index
    copied from pinned memory without blocking): no synchronising CUDA call."""
    gen = torch.Generator().manual_seed(1)
    mixed = [torch.randn(n, generator=gen).to("cuda", dtype) for n in (3, 1000, 70_000)
             for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    backend.concat([backend.partial_stats(mixed, count_zeros=True, deferred=True)])  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        rows = backend.concat([backend.partial_stats(mixed, count_zeros=True, deferred=True)])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert fused_reduce.ENABLED, fused_reduce.disabled_reason
    np.testing.assert_allclose(rows.cpu().numpy(), torch_rows([t.cpu() for t in mixed]), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_the_torch_path_never_synchronises_the_host_either(monkeypatch):
    """With the kernel off (and for float64, which it never takes), the torch path's lengths,
    empty rows and reordering index reach the device from pinned memory without blocking."""
    monkeypatch.setattr(fused_reduce, "ENABLED", False)
    gen = torch.Generator().manual_seed(2)
    mixed = [torch.randn(n, generator=gen).to("cuda", dtype) for n in (0, 3, 1000, 5000, 70_000)
             for dtype in (torch.float32, torch.float64, torch.bfloat16)]
    backend.concat([backend.partial_stats(mixed, count_zeros=True, deferred=True)])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = backend.concat([backend.partial_stats(mixed, count_zeros=True, deferred=True)])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    np.testing.assert_allclose(rows.cpu().numpy(), torch_rows([t.cpu() for t in mixed]), rtol=1e-5)
