"""Overhead of the MindSpore dump (PyNative, CPU): L0, L1 and mix statistics dumps of every step,
L0 and mix sessions that are installed but not dumping (a step outside their `step` list), and
the debugger tasks overflow_check (L1, a clean run: nothing written), free_benchmark (L1,
check, improve_precision: every API call run again in float64) and grad_probe (L1:
statistics and directions of every gradient at every optimizer step; `monitor(optimizer)`,
no start/stop/step).

Copies of the same network (the 4-layer MLP of bench/mindspore_overhead.py, Adam, batch 32)
train side by side in one process, one `value_and_grad` step of each in turn, in a rotating
order (machine noise hits every config alike), at OMP_NUM_THREADS=1; each copy has its own
session (start/stop/step around each of its steps). The L1/mix interception rebinds
MindSpore's public API names for the whole process, but a session routes calls only between
its own start and stop, so the other copies (the tool-free one included) pay one closed-gate
check per API call and layer (measured: nothing visible). Ratio = median step time over the
tool-free median. Each step ends by reading the loss to the host. The LAST printed line is
one JSON object of ratios.

    OMP_NUM_THREADS=1 python bench/mindspore_dump.py [--steps 40] [--warmup 5]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import Tensor, nn  # noqa: E402
from mindspore_overhead import BATCH, make_net  # noqa: E402  (the same network)

from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger  # noqa: E402

CONFIGS = {"L0": {"level": "L0"}, "L1": {"level": "L1"}, "mix": {"level": "mix"},
           "L0 idle": {"level": "L0", "step": [10 ** 9]}, "mix idle": {"level": "mix", "step": [10 ** 9]},
           "overflow L1": {"task": "overflow_check", "level": "L1"},
           "fuzz L1": {"task": "free_benchmark", "level": "L1"}, "grad_probe L1": {"task": "grad_probe"}}


def train_step() -> tuple[nn.Cell, nn.Optimizer, object]:
    """A fresh copy of the network, its Adam and its `value_and_grad` of the MSE loss."""
    net = make_net()
    opt = nn.Adam(net.trainable_params(), 1e-3)
    loss_fn = nn.MSELoss()
    return net, opt, ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)


def make_batches(count: int = 8) -> list[tuple[Tensor, Tensor]]:
    rng = np.random.default_rng(0)
    return [(Tensor(rng.standard_normal((BATCH, 64)).astype(np.float32)),
             Tensor(rng.standard_normal((BATCH, 10)).astype(np.float32))) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for flag, default in (("--steps", 40), ("--warmup", 5)):
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    batches = make_batches()
    out = Path(tempfile.mkdtemp(prefix="msprobe-ms-dump-bench-"))
    runs = {name: (*train_step(), None if name not in CONFIGS else MindSporePrecisionDebugger(
        {"task": "statistics", "dump_path": str(out / name.replace(" ", "_")), **CONFIGS[name]}), [])
        for name in ["no tool", *CONFIGS]}
    for net, opt, _, debugger, _ in runs.values():
        if debugger is not None and debugger.config.task == "grad_probe":
            debugger.monitor(opt)
    names = list(runs)
    for i in range(args.steps + args.warmup):
        x, y = batches[i % len(batches)]
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            net, opt, grad_fn, session, times = runs[name]
            debugger = None if session is None or session.config.task == "grad_probe" else session
            start = time.perf_counter()
            if debugger is not None:
                debugger.start(net)
            loss, grads = grad_fn(x, y)
            opt(grads)
            if debugger is not None:
                debugger.stop()
                debugger.step(grads)
            loss.asnumpy()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
            if session is not None:
                session.flush()  # untimed: the writer thread must not run into the next config's step
    for *_, debugger, _ in reversed(list(runs.values())):  # the interceptions are undone in reverse order
        if debugger is not None:
            debugger.close()
    medians = {name: statistics.median(run[4]) for name, run in runs.items()}
    base = medians.pop("no tool")
    print(f"median step time without the tool: {base * 1e3:.2f} ms (batch {BATCH}, {args.steps} steps, "
          f"PyNative CPU, load {os.getloadavg()[0]:.1f})")
    print("\n".join(f"{name:12s} {median * 1e3:8.2f} ms  x{median / base:.3f}" for name, median in medians.items()))
    print(json.dumps({name: round(median / base, 3) for name, median in medians.items()}))

if __name__ == "__main__":
    main()
