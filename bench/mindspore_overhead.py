"""Monitor overhead on a small MindSpore network (PyNative, CPU): median step time over a run without it.

Copies of the same network (Dense layers with ReLU/Tanh, Adam) train side by side in
one process, one `value_and_grad` step of each in turn, in a rotating order (so
machine noise hits every config alike), at OMP_NUM_THREADS=1. Each step ends by
reading the loss to the host, so queued device work is timed where it was queued.
The LAST printed line is one JSON object mapping each config to its ratio over no
monitor. Goal: everything <= 1.3.

    OMP_NUM_THREADS=1 python bench/mindspore_overhead.py [--steps 60] [--warmup 10]

`--graph`: the same network trained in GRAPH_MODE by a `TrainOneStepCell(..., return_grad=True)`
(every statistic measured inside the compiled graph), one process per configuration
(`configs/full.yaml` with its sinks, a grads+optimizer config, no monitor), in `--rounds` rounds
of every configuration in a rotating order; the ratio of each round's median step time over the
round's run without the monitor, and the median of those ratios on the LAST line (a key per
configuration; `<config> @<width>` for each `--widths` after the first: the same MLP with wider
layers, a step of realistic length). The line before it gives the same ratios of the process CPU
time a step (steadier on a loaded machine). Goals: full.yaml <= 1.5, grads+optimizer <= 1.1.

    OMP_NUM_THREADS=1 python bench/mindspore_overhead.py --graph [--rounds 3] [--steps 60] [--warmup 10] [--widths 128,1024]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import Tensor, nn  # noqa: E402

from msprobe_integrations.mindspore import MindSporeMonitor  # noqa: E402

NONE = {"module_outputs": False, "activation_grads": False, "param_grads": False, "params": False,
        "optimizer_state": []}
CONFIGS = {
    "grads+optimizer": {**NONE, "param_grads": True, "optimizer_state": ["exp_avg", "exp_avg_sq"]},
    "+activations": {**NONE, "param_grads": True, "optimizer_state": ["exp_avg", "exp_avg_sq"], "module_outputs": True},
    "everything": {"module_outputs": True, "module_inputs": True, "activation_grads": True, "param_grads": True,
                   "params": True, "optimizer_state": ["exp_avg", "exp_avg_sq", "update", "ratio"]},
}
WIDTH, BATCH = 128, 32
ROOT = Path(__file__).resolve().parents[1]
#: the GRAPH_MODE configurations (`--graph`), each run in its own process
GRAPH_CONFIGS = {"no monitor": None, "grads+optimizer": str(ROOT / "configs" / "grads_optimizer.yaml"),
                 "full.yaml": str(ROOT / "configs" / "full.yaml")}


def make_net(width: int = WIDTH) -> nn.Cell:
    ms.set_seed(0)
    return nn.SequentialCell(nn.Dense(64, width), nn.ReLU(), nn.Dense(width, width), nn.Tanh(),
                             nn.Dense(width, width), nn.ReLU(), nn.Dense(width, 10))


def graph_worker(name: str, steps: int, warmup: int, width: int) -> tuple[list[float], list[float]]:
    """Step times (wall, process CPU) of configuration `name` of GRAPH_CONFIGS, trained in
    GRAPH_MODE in this process on the MLP of layers `width` wide."""
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    batches = [(Tensor(rng.standard_normal((BATCH, 64)).astype(np.float32)),
                Tensor(rng.standard_normal((BATCH, 10)).astype(np.float32))) for _ in range(8)]
    net = make_net(width)
    opt = nn.Adam(net.trainable_params(), 1e-3)
    monitor = None
    if GRAPH_CONFIGS[name] is not None:
        from msprobe_engine.config.loader import read_file
        config = {**read_file(Path(GRAPH_CONFIGS[name])), "output_dir": tempfile.mkdtemp(prefix="msprobe-ms-graph-")}
        monitor = MindSporeMonitor(net, opt, config)
    train_net = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt, return_grad=True)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(steps + warmup):
        x, y = batches[i % len(batches)]
        start, cpu = time.perf_counter(), time.process_time()
        loss, grads = train_net(x, y)
        if monitor is not None:
            monitor.step_end(loss, grads)
        loss.asnumpy()
        if i >= warmup:
            times[0].append(time.perf_counter() - start)
            times[1].append(time.process_time() - cpu)
    if monitor is not None:
        monitor.close()
    return times


def graph_rounds(rounds: int, steps: int, warmup: int, widths: list[int]) -> None:
    """`--graph`: one process per configuration, width and round, rounds interleaved (see the docstring)."""
    names = list(GRAPH_CONFIGS)
    labels = {(name, width): name if width == widths[0] else f"{name} @{width}" for name in names[1:] for width in widths}
    ratios: dict[tuple[str, int], tuple[list[float], list[float]]] = {key: ([], []) for key in labels}
    for r in range(rounds):
        for width in widths:
            medians = {}
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                out = subprocess.run([sys.executable, __file__, "--graph-worker", name, "--steps", str(steps),
                                      "--warmup", str(warmup), "--widths", str(width)],
                                     capture_output=True, text=True, check=True)
                medians[name] = [statistics.median(t) for t in json.loads(out.stdout.strip().splitlines()[-1])]
            print(f"round {r}, width {width}: " + ", ".join(f"{n} {m[0] * 1e3:.2f} ms (CPU {m[1] * 1e3:.2f} ms)"
                                                            for n, m in medians.items()))
            for name in names[1:]:
                for kind in (0, 1):
                    ratios[name, width][kind].append(medians[name][kind] / medians["no monitor"][kind])
    result = [{labels[key]: round(statistics.median(values[kind]), 3) for key, values in ratios.items()}
              for kind in (0, 1)]
    print(f"GRAPH_MODE, {steps} steps after {warmup}, {rounds} rounds, median of the rounds' ratios; "
          f"of the process CPU time a step: {json.dumps(result[1])}; of the step time:")
    print(json.dumps(result[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--graph", action="store_true", help="GRAPH_MODE, one process per configuration")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--widths", default="128,1024", help="--graph: the MLP's layer widths, comma-separated")
    parser.add_argument("--graph-worker", choices=list(GRAPH_CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.graph_worker:
        print(json.dumps(graph_worker(args.graph_worker, args.steps, args.warmup, int(args.widths))))
        return
    if args.graph:
        graph_rounds(args.rounds, args.steps, args.warmup, [int(w) for w in args.widths.split(",")])
        return
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    out = Path(tempfile.mkdtemp(prefix="msprobe-ms-bench-"))
    rng = np.random.default_rng(0)
    batches = [(Tensor(rng.standard_normal((BATCH, 64)).astype(np.float32)),
                Tensor(rng.standard_normal((BATCH, 10)).astype(np.float32))) for _ in range(8)]
    runs = {}
    for name in ["no monitor", *CONFIGS]:
        net = make_net()
        opt = nn.Adam(net.trainable_params(), 1e-3)
        loss_fn = nn.MSELoss()
        grad_fn = ms.value_and_grad(lambda x, y, net=net, loss_fn=loss_fn: loss_fn(net(x), y), None, opt.parameters)
        monitor = None
        if name in CONFIGS:
            monitor = MindSporeMonitor(net, opt, {"output_dir": str(out / name.replace("+", "_")),
                                                  "watch": CONFIGS[name], "sinks": ["tensorboard"]})
        runs[name] = (net, opt, grad_fn, monitor, [])
    names = list(runs)
    for i in range(args.steps + args.warmup):
        x, y = batches[i % len(batches)]
        shift = i % len(names)  # rotate the order each round, so no config always runs first
        for name in names[shift:] + names[:shift]:
            _, opt, grad_fn, monitor, times = runs[name]
            start = time.perf_counter()
            loss, grads = grad_fn(x, y)
            opt(grads)
            if monitor is not None:
                monitor.step_end(loss, grads)
            loss.asnumpy()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
            if monitor is not None:
                monitor.flush()  # untimed: the writer thread must not run into the next config's step
    for *_, monitor, _ in runs.values():
        if monitor is not None:
            monitor.close()
    base = statistics.median(runs["no monitor"][4])
    params = sum(p.size for p in runs["no monitor"][0].trainable_params())
    print(f"median step time without the monitor: {base * 1e3:.2f} ms "
          f"({params / 1e3:.1f}k params, batch {BATCH}, {args.steps} steps, PyNative CPU)")
    ratios = {}
    for name in CONFIGS:
        median = statistics.median(runs[name][4])
        ratios[name] = round(median / base, 3)
        print(f"{name:20s} {median * 1e3:8.2f} ms  x{ratios[name]:.3f}")
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
