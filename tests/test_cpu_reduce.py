"""The single-pass C kernel for CPU tensors (msprobe_engine/frameworks/torch/cpu_reduce.py).

Its rows are compared with the torch path's rows of the same tensors (the kernel switched off)
and with the float64 numpy reference, on the fused kernel's cases (tests/fused_reduce_cases.py:
every dtype, 1 to 300k elements, nan/inf, empty, zero-dim, signed zeros, views) plus float64,
int64 and int32;
its build, cache, switch and fallback run in subprocesses with their own cache folder.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from msprobe_engine.cpu_kernel import library
from msprobe_engine.frameworks.torch import backend, cpu_reduce
from tests.fused_reduce_cases import cases, compare, monitored_run, run_differences

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def torch_path(monkeypatch):
    """Rows of the torch path: `partial_stats` with the kernel off."""
    def rows(tensors, count_zeros):
        with monkeypatch.context() as m:
            m.setattr(cpu_reduce, "ENABLED", False)
            return backend.partial_stats(list(tensors), count_zeros=count_zeros).numpy()
    return rows


def all_cases():
    gen = torch.Generator().manual_seed(9)
    extra = [(f"randn {n} float64", torch.randn(n, generator=gen, dtype=torch.float64) * 2 - 1)
             for n in (1, 31, 32, 511, 512, 513, 70_001)]
    extra += [(f"randint {n} {dtype}", torch.randint(-3000, 3000, (n,), generator=gen, dtype=dtype))
              for dtype in (torch.int64, torch.int32) for n in (0, 1, 33, 513, 70_001)]
    extra += [("token ids", torch.randint(0, 50_000, (8, 128), generator=gen)),
              ("int64 past float32's integers", torch.tensor([2 ** 40 + 1, -(2 ** 41) - 3, 0, 7]))]
    big = torch.randn(300_001, generator=gen)
    big[::9] = 0.0
    return cases() + extra + [("randn 300001 float32 with zeros", big), ("subnormals", torch.full((6000,), 1e-40)),
                              ("squares past float32", torch.full((3000,), 1e25))]


@pytest.mark.parametrize("count_zeros", [True, False])
def test_rows_match_the_torch_path_and_the_float64_reference_alone_and_batched(torch_path, count_zeros):
    assert cpu_reduce.available(), cpu_reduce.disabled_reason
    named = all_cases()
    tensors = [t for _, t in named]
    want = torch_path(tensors, count_zeros)
    batched = cpu_reduce.rows(tensors, count_zeros).numpy()  # every dtype in one call
    problems = []
    for (name, t), got, cpu in zip(named, batched, want):
        alone = cpu_reduce.rows([t], count_zeros).numpy()[0]
        exact_columns = cpu.copy()
        exact_columns[2:4] = got[2:4]  # sums: against the float64 reference (the torch path's sum of
        problems += compare(name, got, exact_columns, t, count_zeros)  # squares is float32, less exact)
        if not np.array_equal(alone, got, equal_nan=True):  # a tensor's row depends on its own values only
            problems.append(f"{name}: alone {alone.tolist()} != batched {got.tolist()}")
    assert not problems, problems[:10]
    assert len(named) > 60


def test_rows_of_differences_are_those_of_the_difference_written_bit_for_bit():
    """`difference_rows(a, b)` (the optimizer's update, never written) equals the rows of ``a - b``
    materialised, every column bit for bit, float32 and float64, with nan, inf and zeros; other
    dtypes are refused (None) and `backend.difference_stats` measures their difference written."""
    gen = torch.Generator().manual_seed(3)
    after, before = [], []
    for dtype in (torch.float32, torch.float64):
        for n in (0, 1, 513, 70_001):
            a = torch.randn(n, generator=gen, dtype=dtype)
            b = a + torch.randn(n, generator=gen, dtype=dtype) * 1e-3
            b[:n // 3] = a[:n // 3]  # zeros of the difference
            after.append(a)
            before.append(b)
    after[2][7], after[3][9], before[7][5] = float("nan"), float("inf"), float("-inf")
    for count_zeros in (False, True):
        got = cpu_reduce.difference_rows(after, before, count_zeros)
        want = cpu_reduce.rows([a - b for a, b in zip(after, before)], count_zeros)
        assert got.numpy().tobytes() == want.numpy().tobytes()
    half = [torch.randn(64, generator=gen).half() for _ in range(2)]
    assert cpu_reduce.difference_rows(half[:1], half[1:]) is None
    np.testing.assert_array_equal(backend.difference_stats(half[:1], half[1:]).numpy(),
                                  backend.partial_stats([half[0] - half[1]]).numpy())


class Tagged(torch.Tensor):
    """A tensor subclass, as DTensor is one."""


def test_the_backend_hands_float_and_integer_cpu_tensors_to_the_kernel_and_keeps_the_rest_in_order(
        torch_path, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(100, generator=gen), torch.arange(10), torch.arange(3, dtype=torch.int16),
               torch.randn(5000, generator=gen).half(),
               torch.tensor([True, False]), torch.randn(3, 4, generator=gen, dtype=torch.complex64),
               torch.randn(80_000, generator=gen).bfloat16(), torch.randn(7, generator=gen)._neg_view(),
               torch.randn(9, generator=gen).as_subclass(Tagged), torch.nn.Parameter(torch.randn(6, generator=gen))]
    seen = []
    real_rows = cpu_reduce.rows
    monkeypatch.setattr(cpu_reduce, "rows", lambda ts, zeros: seen.append([t.dtype for t in ts]) or real_rows(ts, zeros))
    got = backend.partial_stats(tensors, count_zeros=True).numpy()
    # int16, bools, complex, a negated view, a subclass (a DTensor's data_ptr is not its values): the torch path
    assert seen == [[torch.float32, torch.int64, torch.float16, torch.bfloat16, torch.float32]]
    np.testing.assert_allclose(got, torch_path(tensors, True), rtol=1e-6, equal_nan=True)
    with pytest.warns(UserWarning, match="nested"):
        nested = torch.nested.nested_tensor([torch.randn(3, generator=gen), torch.randn(5, generator=gen)])
    assert not cpu_reduce.eligible(nested, parallel=False)  # nested tensors stay where they were
    deferred = [backend.partial_stats([t], count_zeros=True, deferred=True) for t in tensors]
    np.testing.assert_array_equal(backend.concat(deferred).numpy(), got)  # one tensor a call: the same rows


def test_a_tensor_whose_storage_was_freed_is_an_error_not_a_read_out_of_bounds():
    freed = torch.randn(1000)
    freed.untyped_storage().resize_(0)  # what a sharding wrapper does to an unsharded parameter
    with pytest.raises(ValueError, match=r"shape \(1000,\) has 0 bytes of storage"):
        cpu_reduce.rows([torch.randn(3), freed])


def test_with_several_torch_threads_long_tensors_stay_on_torchs_parallel_reductions(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    short, long = torch.randn(1000), torch.randn(cpu_reduce.PARALLEL_NUMEL + 1)
    positions, rows = cpu_reduce.measure([long, short], count_zeros=False)
    assert positions == [1] and rows.shape == (1, 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert cpu_reduce.measure([long, short], count_zeros=False)[0] == [0, 1]


SCRIPT = r"""
import json, logging, sys, torch
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from msprobe_engine.frameworks.torch import backend, cpu_reduce
x = torch.randn(5000)
rows = backend.partial_stats([x, x * 2], count_zeros=True).numpy()
print(json.dumps({"available": cpu_reduce.available(), "reason": cpu_reduce.disabled_reason,
                  "measured": cpu_reduce.measure([x], False) is not None,
                  "max": rows[:, 1].tolist(), "want": [float(x.max()), float((x * 2).max())]}))
"""


def run(env: dict, cache: Path) -> tuple[dict, str]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MSPROBE_CACHE_DIR": str(cache),
            "MSPROBE_CPU_KERNEL": "build", **env}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=full, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_the_library_is_built_once_into_the_cache_and_loaded_from_it_later(tmp_path):
    """The run-time build (MSPROBE_CPU_KERNEL=build); the compiler is part of the cache key, so a
    later run still needs it (a run with no compiler at all is served by the packaged library)."""
    first, _ = run({}, tmp_path)
    assert first["available"] and first["measured"] and first["reason"] is None
    built = list(tmp_path.glob("cpu_reduce-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    second, _ = run({}, tmp_path)  # loaded, not compiled again
    assert second["available"] and second["max"] == second["want"]
    assert built[0].stat().st_mtime_ns == stamp and list(tmp_path.glob("*.so")) == built


def test_without_a_compiler_or_with_the_switch_off_the_torch_path_measures_and_says_why(tmp_path):
    no_cc, log = run({"CC": "/nonexistent/cc"}, tmp_path / "a")
    assert not no_cc["available"] and not no_cc["measured"]
    assert "CPU reduction kernel off" in log and "/nonexistent/cc" in log and log.count("kernel off") == 1
    off, log = run({"MSPROBE_CPU_KERNEL": "0"}, tmp_path / "b")
    assert off["reason"] == "MSPROBE_CPU_KERNEL=0" and not off["measured"] and "kernel off" not in log
    assert not (tmp_path / "b").exists()  # nothing built
    for result in (no_cc, off):
        assert result["max"] == result["want"]


def test_a_compile_error_is_reported_with_the_compilers_message(tmp_path, monkeypatch):
    bad = tmp_path / "broken.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(library, "SOURCE", bad)
    monkeypatch.setenv("MSPROBE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"failed on broken\.c: .*error"):
        library.build()
    assert not list((tmp_path / "cache").glob("*.so"))


STALE = """
import json, sys
from pathlib import Path
import torch
from msprobe_engine.cpu_kernel import library
from msprobe_engine.frameworks.torch import backend, cpu_reduce
library.path = lambda: Path(sys.argv[1])
ids = torch.arange(5)
print(json.dumps({"available": cpu_reduce.available(), "reason": cpu_reduce.disabled_reason,
                  "max": backend.partial_stats([ids]).tolist()[0][1]}))
"""


def test_a_library_built_from_an_older_source_is_refused_not_misread(tmp_path):
    """A checkout's package library not rebuilt since int64/int32 were added would read their codes
    as bfloat16; one without `msprobe_cpu_dtypes` (as the older source built) is refused, and the
    torch path measures."""
    source = library.SOURCE.read_text()
    older = tmp_path / "older.c"
    older.write_text("\n".join(line for line in source.splitlines() if "msprobe_cpu_dtypes" not in line))
    built = tmp_path / "older.so"
    subprocess.run(["cc", *library.FLAGS, str(older), "-o", str(built)], check=True, timeout=300)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MSPROBE_CPU_KERNEL": "1"}
    proc = subprocess.run([sys.executable, "-c", STALE, str(built)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["available"] and "older source" in result["reason"] and "reads 4 dtypes" in result["reason"]
    assert result["max"] == 4.0


def test_a_cache_folder_others_may_write_into_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("MSPROBE_CACHE_DIR", str(shared))
    with pytest.raises(RuntimeError, match="not private"):
        library.build()
    assert not list(shared.iterdir())


def test_ranks_building_at_once_compile_once_and_the_compiler_is_in_the_key(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MSPROBE_CACHE_DIR": str(tmp_path),
           "MSPROBE_CPU_KERNEL": "build"}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    assert all(r["available"] and r["max"] == r["want"] for r in results)
    assert len(list(tmp_path.glob("cpu_reduce-*.so"))) == 1
    wrapper = tmp_path / "bin" / "cc"  # another compiler (a wrapper with its own --version): its own library
    wrapper.parent.mkdir()
    wrapper.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo other-cc 1.0; exit 0; }\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    other, _ = run({"CC": str(wrapper)}, tmp_path)
    assert other["available"] and len(list(tmp_path.glob("cpu_reduce-*.so"))) == 2


#: a user's HF Trainer script, run from the installed wheel outside this repository
HF_SCRIPT = r"""
import json, torch, msprobe_integrations
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from msprobe_integrations.hf import MonitorCallback
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (12, 16))]
args = TrainingArguments("hf_out", max_steps=3, per_device_train_batch_size=4, report_to=[], use_cpu=True)
callback = MonitorCallback(config="full")
Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
history = callback.monitor.history
print(json.dumps({"package": msprobe_integrations.__file__, "steps": [r.step for r in history],
                  "activations": sum(k.startswith("actv/") for k in history[-1].metrics)}))
"""


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory) -> Path:
    """The package as `pip wheel` builds it (setup.py compiles the kernel into it), unpacked."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheels = tmp / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                           "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = tmp / "site"
    [wheel] = wheels.glob("*.whl")
    zipfile.ZipFile(wheel).extractall(site)
    return site


def run_installed(site: Path, script: str, tmp_path: Path) -> dict:
    """`script` run outside this repository with the unpacked wheel first on the path and no
    compiler anywhere (PATH empty); its last stdout line as JSON."""
    env = {"PATH": str(tmp_path / "empty"), "HOME": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(site), "MSPROBE_CACHE_DIR": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf"),
           "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_wheel_carries_the_built_kernel_and_loads_it_with_no_compiler_on_path(wheel_site, tmp_path):
    """Installed from the wheel, the kernel loads with no compiler anywhere and no cache written."""
    assert list((wheel_site / "msprobe_engine" / "cpu_kernel").glob("_cpu_reduce*.so"))
    result = run_installed(wheel_site, SCRIPT, tmp_path)
    assert result["available"] and result["measured"] and result["max"] == result["want"], result
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_an_hf_trainer_script_runs_from_the_wheel_with_the_shipped_config_by_name(wheel_site, tmp_path):
    """README's way in, outside this repository: `MonitorCallback(config="full")` finds the config
    inside the installed package, and the run is written where full.yaml says (./msprobe_output)."""
    result = run_installed(wheel_site, HF_SCRIPT, tmp_path)
    assert Path(result["package"]).is_relative_to(wheel_site), result
    assert result["steps"] == [1, 2, 3] and result["activations"] > 0, result
    assert list((tmp_path / "msprobe_output").rglob("*.jsonl")), sorted(map(str, tmp_path.rglob("*")))
    assert not (tmp_path / "cache").exists()


def test_a_monitored_run_records_the_same_statistics_with_the_kernel_and_the_torch_path(tmp_path, monkeypatch):
    """Outputs, activation and parameter gradients, parameters and optimizer state with every
    statistic (tests/fused_reduce_cases.py's run): the same losses bit for bit, min, max, counts
    and zero_frac exactly, mean and norm within 1e-5."""
    monkeypatch.setattr(cpu_reduce, "ENABLED", False)
    want = monitored_run("cpu", str(tmp_path / "torch"), steps=3)
    monkeypatch.setattr(cpu_reduce, "ENABLED", True)
    got = monitored_run("cpu", str(tmp_path / "kernel"), steps=3)
    assert not run_differences(got, want, steps=3)
