"""Cases and checks of the fused reduction kernel (msprobe_engine/frameworks/torch/fused_reduce.py),
shared by its interpreter test (this file run as a script, TRITON_INTERPRET=1, CPU tensors)
and its GPU test (imported, compiled kernels, CUDA tensors).

Every check compares the kernel's rows with the backend's rows of the same tensors on the CPU
(the CPU path: the C kernel of cpu_reduce.py, or the torch path where it is off) and with the
float64 numpy reference: min, max, the counts and numel exactly
(nan equal to nan), sum and sum of squares within the tolerances of tests/test_stats.py.

    TRITON_INTERPRET=1 python tests/fused_reduce_cases.py [--quick]   # one JSON line; exit 1 on a mismatch
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from msprobe_engine.frameworks.torch import backend, fused_reduce  # noqa: E402
from msprobe_engine.stats import reference_partial  # noqa: E402

SMALL = backend.SMALL_NUMEL
SEG = fused_reduce.SEGMENT
SIZES = [1, 7, 1000, SMALL, SMALL + 1, SEG, SEG + 1, backend.FOREACH_NUMEL, backend.FOREACH_NUMEL + 1, 70_001]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def edge_tensors() -> dict[str, torch.Tensor]:
    """Named float32 edge cases (converted to each dtype by `cases`)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(70_001, generator=gen)
    nan_inf = x.clone()
    nan_inf[[0, 5, 40_000]] = math.nan
    nan_inf[[1, 70_000]] = math.inf
    nan_inf[2] = -math.inf
    only_inf = x.clone()
    only_inf[[3, 20_000]] = math.inf
    only_inf[30_000] = -math.inf
    signed_zeros = torch.randn(3000, generator=gen)
    signed_zeros[::7] = 0.0
    signed_zeros[1::7] = -0.0
    base = torch.randn(64, 1100, generator=gen)
    return {
        "empty": torch.zeros(0),
        "empty 2-d": torch.zeros(3, 0),
        "zero-dim": torch.tensor(2.5),
        "one element": torch.tensor([-4.0]),
        "one nan": torch.tensor([math.nan]),
        "all nan": torch.full((5000,), math.nan),
        "all zeros": torch.zeros(20_000),
        "signed zeros": signed_zeros,
        "nan and inf, 70k": nan_inf,
        "inf and -inf, no nan": only_inf,
        "inf only": torch.full((9,), math.inf),
        "transposed": base.t(),
        "strided slice": base[:, ::3],
        "offset view (unaligned)": x[1:33_000],
        "expanded": torch.randn(1, 300, generator=gen).expand(40, 300),
        "large values": torch.full((20_000,), 1e15),
    }


def cases() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    out = []
    for dtype in DTYPES:
        for n in SIZES:
            out.append((f"randn {n} {dtype}", (torch.randn(n, generator=gen) * 3 + 0.5).to(dtype)))
        for name, t in edge_tensors().items():
            if name == "large values" and dtype == torch.float16:
                continue  # 1e15 is inf in float16: covered by the inf cases
            out.append((f"{name} {dtype}", t.to(dtype)))
    out.append(("randn 300000 float32", torch.randn(300_000, generator=gen)))
    return out


def compare(name: str, got: np.ndarray, cpu: np.ndarray, t: torch.Tensor, count_zeros: bool) -> list[str]:
    """Mismatches of one row with the CPU path's row and the float64 reference."""
    problems = []
    values = t.detach().cpu().float().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.cpu().numpy()
    ref = reference_partial(values).copy()
    if not count_zeros and t.numel():
        ref[6] = math.nan  # the zero count not taken
    rtol = 1e-6 if t.numel() <= SMALL else 1e-5
    scale = float(np.abs(values.astype(np.float64)).sum()) if t.numel() else 0.0
    for want, what in ((cpu, "cpu path"), (ref, "float64 reference")):
        for col in (0, 1, 4, 5, 6, 7):  # min, max, counts, numel: exact
            if not (got[col] == want[col] or (np.isnan(got[col]) and np.isnan(want[col]))):
                problems.append(f"{name}: column {col} {got[col]!r} != {what} {want[col]!r}")
        for col, tol_scale in ((2, scale), (3, None)):  # sum (atol by the sum of |x|), sumsq
            g, w = got[col], want[col]
            if np.isnan(g) or np.isnan(w) or np.isinf(g) or np.isinf(w):
                if not (g == w or (np.isnan(g) and np.isnan(w))):
                    problems.append(f"{name}: column {col} {g!r} != {what} {w!r}")
                continue
            atol = rtol * tol_scale if tol_scale is not None else 0.0
            if abs(g - w) > atol + rtol * abs(w):
                problems.append(f"{name}: column {col} {g!r} vs {what} {w!r} (rtol {rtol})")
    return problems


def check(device: str, quick: bool = False) -> dict:
    """Every case through `fused_reduce.rows` on `device`, all of one dtype in one call and one
    tensor a call, with and without the zero count; then mixed batches through
    `backend.partial_stats` with the kernel as its hook, and a monitored training run. Returns a summary with the problems.
    `quick` (the interpreter's quick lane): the batched calls with the zero count only, tensors
    above 20k elements in float32 only and none above 100k, no training run."""
    problems: list[str] = []
    all_cases = [(name, t) for name, t in cases()
                 if not quick or t.numel() <= 20_000 or (t.dtype == torch.float32 and t.numel() < 100_000)]
    started = time.perf_counter()
    checked = 0
    for count_zeros in (True,) if quick else (False, True):  # quick: the hook check has both
        cpu_rows = {name: backend.partial_stats([t], count_zeros=count_zeros).numpy()[0] for name, t in all_cases}
        for name, t in [] if quick else all_cases:  # one tensor a call
            got = fused_reduce.rows([t.to(device)], count_zeros).cpu().numpy()[0]
            problems += compare(f"{name} zeros={count_zeros}", got, cpu_rows[name], t, count_zeros)
            checked += 1
        for dtype in DTYPES:  # every tensor of a dtype in one call (one pair of launches)
            group = [(name, t) for name, t in all_cases if t.dtype == dtype]
            got = fused_reduce.rows([t.to(device) for _, t in group], count_zeros).cpu().numpy()
            for row, (name, t) in zip(got, group):
                problems += compare(f"{name} batched zeros={count_zeros}", row, cpu_rows[name], t, count_zeros)
                checked += 1
    problems += check_many(device, count=37 if quick else 257)
    problems += check_backend_hook(device)
    if not quick:
        problems += check_monitor(device)
    return {"device": device, "quick": quick, "checked_rows": checked, "problems": problems[:40], "n_problems": len(problems),
            "seconds": round(time.perf_counter() - started, 2)}


def check_many(device: str, count: int = 257) -> list[str]:
    """One call of `count` tensors (not a power of two) of 0 to 40k elements, empty ones among
    them: every program finds its tensor (binary search over the segment table)."""
    gen = torch.Generator().manual_seed(7)
    sizes = torch.randint(0, 3000, (count,), generator=gen).tolist()
    sizes[::50] = [0] * len(sizes[::50])
    sizes[7], sizes[count // 2], sizes[-1] = 40_000, SEG + 3, 2 * SEG
    ts = [torch.randn(n, generator=gen) for n in sizes]
    got = fused_reduce.rows([t.to(device) for t in ts], True).cpu().numpy()
    want = backend.partial_stats(ts, count_zeros=True).numpy()
    problems = []
    for i, (row, t) in enumerate(zip(got, ts)):
        problems += compare(f"many: tensor {i} of {count} ({t.numel()} elements)", row, want[i], t, True)
    return problems


def check_backend_hook(device: str) -> list[str]:
    """`backend.partial_stats` with the kernel as its hook on `device` against the torch path on
    the CPU: a mixed batch (float64, int, bool, complex, sparse, repeated tensors stay on the
    torch path), deferred blocks, `concat` and `pick`."""
    gen = torch.Generator().manual_seed(6)
    shared = torch.randn(5000, generator=gen)
    mixed = [torch.randn(10, generator=gen), torch.randn(3000, generator=gen, dtype=torch.float64),
             torch.randint(-5, 5, (40,), generator=gen), shared, torch.tensor([True, False]),
             torch.randn(70_000, generator=gen).to(torch.bfloat16), shared, torch.zeros(0),
             torch.tensor([1 + 2j, 3 - 1j]), torch.tensor([[0.0, 2.0], [1.5, 0.0]]).to_sparse(),
             torch.randn(200, generator=gen).half(), torch.full((4,), math.nan)]
    problems = []
    devices_before = fused_reduce.DEVICES
    try:
        for count_zeros in (False, True):
            fused_reduce.DEVICES = ()
            want = backend.partial_stats(mixed, count_zeros=count_zeros).numpy()
            fused_reduce.DEVICES = (torch.device(device).type,)
            on_device = [t.to(device) for t in mixed]
            got = backend.partial_stats(on_device, count_zeros=count_zeros).cpu().numpy()
            first = backend.partial_stats(on_device[:6], count_zeros=count_zeros, deferred=True)
            second = backend.partial_stats(on_device[6:], count_zeros=count_zeros, deferred=True)
            packed = backend.concat([first, second]).cpu().numpy()
            picked = backend.concat([backend.pick([(first, 5), (second, 0), (first, 0)])]).cpu().numpy()
            for i, t in enumerate(mixed):
                problems += compare(f"hook row {i} zeros={count_zeros}", got[i], want[i], t, count_zeros) \
                    if t.is_floating_point() and t.layout == torch.strided \
                    else _same(f"hook row {i} zeros={count_zeros}", got[i], want[i])
                problems += _same(f"concat row {i} zeros={count_zeros}", packed[i], got[i])
            for row, i in zip(picked, (5, 6, 0)):
                problems += _same(f"picked row {i} zeros={count_zeros}", row, got[i])
    finally:
        fused_reduce.DEVICES = devices_before
    if not fused_reduce.ENABLED:
        problems.append(f"the kernel turned itself off: {fused_reduce.disabled_reason}")
    return problems


def monitored_run(device: str, out_dir: str, steps: int = 2) -> tuple[torch.Tensor, list[dict]]:
    """A small model trained on `device` under `TorchMonitor` (outputs, activation and parameter
    gradients, parameters, optimizer state; every statistic with zero_frac): its losses and records."""
    from torch import nn

    from msprobe_integrations.torch import TorchMonitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128),
                          nn.Linear(128, 50)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"output_dir": out_dir, "sinks": [], "strict": True,
              "stats": ["min", "max", "mean", "norm", "nan_count", "inf_count", "zero_frac"],
              "watch": {"module_outputs": True, "activation_grads": True, "param_grads": True, "params": True,
                        "optimizer_state": ["exp_avg", "exp_avg_sq", "update"]}}
    monitor = TorchMonitor(model, opt, config)
    tokens = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(1)).to(device)
    losses = []
    for _ in range(steps):
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        monitor.step_end(loss)
        losses.append(loss.detach().cpu())
    monitor.close()
    return torch.stack(losses), [dict(r.metrics) for r in monitor.history]


def run_differences(got: tuple[torch.Tensor, list[dict]], want: tuple[torch.Tensor, list[dict]], steps: int) -> list[str]:
    """How two `monitored_run`s differ: losses bit for bit; min, max, counts and zero_frac exactly,
    mean and norm within 1e-5 (the monitor's own cost left out)."""
    (got_losses, got), (want_losses, want) = got, want
    problems = [] if torch.equal(want_losses, got_losses) else [f"monitor: losses differ {got_losses} {want_losses}"]
    for step, (g, w) in enumerate(zip(got, want)):
        if set(g) != set(w):
            problems.append(f"monitor step {step}: tags differ {sorted(set(g) ^ set(w))[:5]}")
        for tag in sorted(set(g) & set(w)):
            if tag.startswith("monitor/") or tag.endswith("monitor_ms"):  # the monitor's own cost
                continue
            a, b = float(g[tag]), float(w[tag])
            exact = tag.rsplit("/", 1)[-1] in ("min", "max", "nan_count", "inf_count", "zero_frac", "numel")
            close = a == b or (math.isnan(a) and math.isnan(b)) or (not exact and math.isclose(a, b, rel_tol=1e-5,
                                                                                              abs_tol=1e-7))
            if not close:
                problems.append(f"monitor step {step} {tag}: {a!r} != {b!r}")
    if len(got) != steps or not any(tag.endswith("/zero_frac") for tag in got[0]):
        problems.append(f"monitor: {len(got)} records, tags {sorted(got[0])[:5] if got else []}")
    return problems


def check_monitor(device: str, steps: int = 2) -> list[str]:
    """`monitored_run` on `device` once with the Triton kernel and once without it (the backend's
    other path: on CPU the C kernel): no difference."""
    import tempfile
    devices_before = fused_reduce.DEVICES
    try:
        with tempfile.TemporaryDirectory() as tmp:
            fused_reduce.DEVICES = ()
            want = monitored_run(device, f"{tmp}/torch", steps)
            fused_reduce.DEVICES = (torch.device(device).type,)
            got = monitored_run(device, f"{tmp}/fused", steps)
    finally:
        fused_reduce.DEVICES = devices_before
    return run_differences(got, want, steps)


def _same(name: str, a: np.ndarray, b: np.ndarray) -> list[str]:
    return [] if np.array_equal(a, b, equal_nan=True) else [f"{name}: {a.tolist()} != {b.tolist()}"]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs TRITON_INTERPRET=1 (CPU tensors) or a CUDA device"}))
        return 0
    torch.set_num_threads(1)
    np.seterr(invalid="ignore")  # nan sums in the reference and the interpreter
    summary = check("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda", quick="--quick" in sys.argv)
    print(json.dumps(summary))
    return 1 if summary["n_problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
