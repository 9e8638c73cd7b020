"""Monitor overhead under Megatron-core: median step time with the monitor over without it.

The tiny GPT (4 layers, hidden 128, 2 micro-batches of 4 x 64 tokens) trains with
tensor parallel 2, data parallel 2 (distributed optimizer), or as a mixture of experts
(`--parallel ep`: every MLP 4 experts, top-2, expert parallel 2: two experts per rank; the
routers' health watched too) on two gloo CPU ranks, at OMP_NUM_THREADS=1. Three copies of the model live in the same two processes: without
the tool, with configs/megatron/monitor.yaml, and with everything watched every step
(module outputs and inputs, activation gradients, gradients, weights, Adam's moments,
updates and update/weight ratios; as "everything" in bench/overhead.py). One step of
each in turn, the order rotating every round, so machine noise hits every config
alike. Times are rank 0's; the thread CPU time per step (`time.thread_time`, less sensitive to
the machine's load than the wall clock) is printed for each rank. The LAST printed line is one JSON object mapping each
config to its ratio over no tool (goal: <= 1.3).

    OMP_NUM_THREADS=1 python bench/megatron_overhead.py [--parallel tp|dp|ep] [--steps 40] [--warmup 5]
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
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.multiproc import run_ranks  # noqa: E402

EVERYTHING = {"watch": {"module_outputs": True, "module_inputs": True, "activation_grads": True,
                        "param_grads": True, "params": True,
                        "optimizer_state": ["exp_avg", "exp_avg_sq", "update", "ratio"]},
              "sinks": ["tensorboard"]}


def rank_main(rank: int, world: int, parallel: str, steps: int, warmup: int, out: str) -> dict:
    import torch

    from msprobe_engine.config.loader import read_file
    configs = {"megatron/monitor.yaml": read_file(ROOT / "configs" / "megatron" / "monitor.yaml"),
               "everything": EVERYTHING}
    from msprobe_integrations.megatron import MegatronMonitor
    from tests import megatron_helpers as H

    torch.set_num_threads(1)
    H.init_parallel(tp=2 if parallel == "tp" else 1, ep=2 if parallel == "ep" else 1)
    spec = H.TinySpec(layers=4, hidden=128, heads=4, vocab=256, seq=64, batch=4, experts=4 if parallel == "ep" else 0)
    own_data = parallel in ("dp", "ep")  # each rank its own micro-batches
    runs = {}
    for name in ["no tool", *configs]:
        model = H.wrap_ddp(H.build_gpt(spec), distributed_optimizer=parallel == "dp")
        optimizer = H.build_optimizer([model])
        monitor = None
        if name in configs:
            config = {**configs[name], "output_dir": str(Path(out) / name.replace("/", "_"))}
            monitor = MegatronMonitor([model], optimizer, config=config)
        runs[name] = (model, optimizer, monitor, [], [])
    names = list(runs)
    for i in range(steps + warmup):
        batches = H.micro_batches(spec, 2, seed=i * world + (rank if own_data else 0))
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            model, optimizer, monitor, times, cpu = runs[name]
            start, start_cpu = time.perf_counter(), time.thread_time()
            loss, _, _ = H.train_step(model, optimizer, batches)
            if monitor is not None:
                monitor.step_end(loss)
            if i >= warmup:
                times.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - start_cpu)
    for _, _, monitor, _, _ in runs.values():
        if monitor is not None:
            monitor.close()
    return {name: (statistics.median(run[3]), statistics.median(run[4])) for name, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", choices=["tp", "dp", "ep"], default="tp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="msprobe-megatron-bench-")
    per_rank = run_ranks(rank_main, 2, args.parallel, args.steps, args.warmup, out, timeout=1800)
    for rank, medians in enumerate(per_rank):
        print(f"rank {rank} thread CPU per step: " + ", ".join(f"{name} {cpu * 1e3:.2f} ms" for name, (_, cpu)
                                                               in medians.items()))
    medians = {name: wall for name, (wall, _) in per_rank[0].items()}
    base = medians.pop("no tool")
    print(f"{args.parallel.upper()}=2, median step time without the tool: {base * 1e3:.2f} ms ({args.steps} steps)")
    ratios = {}
    for name, median in medians.items():
        ratios[name] = round(median / base, 3)
        print(f"{name:24s} {median * 1e3:8.2f} ms  x{ratios[name]:.3f}")
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
