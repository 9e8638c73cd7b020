"""Overhead of the MindSpore dump (PyNative, CPU): L0, L1 and mix statistics dumps of every step,
and an L1 session that is installed but not dumping (a step outside its `step` list).

The L1/mix interception rebinds MindSpore's public API names for the whole session, so the
configs cannot train side by side with a tool-free copy in one process. Instead each round
runs every config for `--steps` steps on the same network (a 4-layer MLP, Adam, batch 32),
one config after another in a rotating order, creating the session before its phase and
closing it after (untimed), with a tool-free phase in every round; the first `--warmup` steps
of each phase are not timed. Ratio = median step time over the tool-free median.
Each step ends by reading the loss to the host, at OMP_NUM_THREADS=1. The LAST printed line
is one JSON object of ratios.

    OMP_NUM_THREADS=1 python bench/mindspore_dump.py [--rounds 4] [--steps 12] [--warmup 2]
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
           "L1 idle": {"level": "L1", "step": [10 ** 9]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for flag, default in (("--rounds", 4), ("--steps", 12), ("--warmup", 2)):
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    out = Path(tempfile.mkdtemp(prefix="msprobe-ms-dump-bench-"))
    rng = np.random.default_rng(0)
    shapes = ((BATCH, 64), (BATCH, 10))
    batches = [tuple(Tensor(rng.standard_normal(shape).astype(np.float32)) for shape in shapes) for _ in range(8)]
    net = make_net()
    opt = nn.Adam(net.trainable_params(), 1e-3)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    names = ["no tool", *CONFIGS]
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            debugger = None
            if name in CONFIGS:
                debugger = MindSporePrecisionDebugger(task="statistics", dump_path=str(out / f"{round_}-{name}"),
                                                      **CONFIGS[name])
            for i in range(args.steps + args.warmup):
                x, y = batches[i % len(batches)]
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
                    times[name].append(time.perf_counter() - start)
                if debugger is not None:
                    debugger.flush()  # untimed: the writer thread must not run into the next step
            if debugger is not None:
                debugger.close()
    base = statistics.median(times["no tool"])
    params = sum(p.size for p in net.trainable_params())
    print(f"median step time without the tool: {base * 1e3:.2f} ms ({params / 1e3:.1f}k params, batch {BATCH}, "
          f"{args.rounds} rounds x {args.steps} steps per config, PyNative CPU, load {os.getloadavg()[0]:.1f})")
    ratios = {}
    for name in CONFIGS:
        median = statistics.median(times[name])
        ratios[name] = round(median / base, 3)
        print(f"{name:10s} {median * 1e3:8.2f} ms  x{ratios[name]:.3f}")
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
