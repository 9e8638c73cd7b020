"""Monitor overhead on the demo model: median step time over a run without the tool.

Five copies of the same model train side by side in one process, one step of
each in turn, in a rotating order (so machine noise hits every config alike), at
OMP_NUM_THREADS=1. The LAST printed line is one JSON object mapping each
config to its ratio over no tool. Goals: everything <= 1.3, grads+optimizer <= 1.05.

    OMP_NUM_THREADS=1 python bench/overhead.py [--steps 60] [--warmup 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from examples.tiny_gpt import TinyGPT, synthetic_batches  # noqa: E402
from msprobe_integrations.torch import TorchMonitor  # noqa: E402

NONE = {"module_outputs": False, "activation_grads": False, "param_grads": False, "params": False,
        "optimizer_state": []}
CONFIGS = {
    "grads": {**NONE, "param_grads": True},
    "grads+optimizer": {**NONE, "param_grads": True, "optimizer_state": ["exp_avg", "exp_avg_sq"]},
    "grads+optimizer+activations": {**NONE, "param_grads": True, "optimizer_state": ["exp_avg", "exp_avg_sq"],
                                    "module_outputs": True},
    "everything": {"module_outputs": True, "module_inputs": True, "activation_grads": True, "param_grads": True,
                   "params": True, "optimizer_state": ["exp_avg", "exp_avg_sq", "update", "ratio"]},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp(prefix="msprobe-bench-"))
    runs = {}
    for name in ["no tool", *CONFIGS]:
        torch.manual_seed(0)
        model = TinyGPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        monitor = None
        if name in CONFIGS:
            monitor = TorchMonitor(model, opt, {"output_dir": str(out / name.replace("+", "_")),
                                                "watch": CONFIGS[name],
                                                "stats": ["min", "max", "mean", "norm", "nan_count", "inf_count"],
                                                "sinks": ["tensorboard"]})
        runs[name] = (model, opt, monitor, synthetic_batches(model.cfg, args.steps + args.warmup), [])
    names = list(runs)
    for i in range(args.steps + args.warmup):
        shift = i % len(names)  # rotate the order each round, so no config always runs first
        for name in names[shift:] + names[:shift]:
            model, opt, monitor, batches, times = runs[name]
            tokens, targets = next(batches)
            start = time.perf_counter()
            loss = model(tokens, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if monitor is not None:
                monitor.step_end(loss)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    for _, _, monitor, _, _ in runs.values():
        if monitor is not None:
            monitor.close()
    base = statistics.median(runs["no tool"][4])
    print(f"median step time without the tool: {base * 1e3:.2f} ms "
          f"({sum(p.numel() for p in runs['no tool'][0].parameters()) / 1e6:.2f}M params, {args.steps} steps)")
    ratios = {}
    for name in CONFIGS:
        median = statistics.median(runs[name][4])
        ratios[name] = round(median / base, 3)
        print(f"{name:30s} {median * 1e3:8.2f} ms  x{ratios[name]:.3f}")
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
