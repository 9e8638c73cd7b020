"""Monitor overhead under Megatron-core: median step time with the monitor over without it.

The tiny GPT (4 layers, hidden 128, 2 micro-batches of 4 x 64 tokens) trains with
tensor parallel 2, data parallel 2 (distributed optimizer), or as a mixture of experts
(`--parallel ep`: every MLP 4 experts, top-2, expert parallel 2: two experts per rank; the
routers' health watched too) on two gloo CPU ranks, at OMP_NUM_THREADS=1, in five
configurations: without the tool, with configs/megatron/monitor.yaml, with everything watched
every step (module outputs and inputs, activation gradients, gradients, weights, Adam's moments,
updates and update/weight ratios; as "everything" in bench/overhead.py), and the floor of each
of the two (`floor <config>`: bench/modes.py's `Floor`, the least any tool must do for what the
config watches: the same modules hooked, ONE sum per tensor kept on the device, the step's sums
all-reduced over the ranks in one collective, one host transfer).
Each configuration trains in a pair of rank processes of its own, its steps back to back, as
in a run, so the monitor's writer thread works in its own configuration's steps and in no
other's; a round runs the five pairs one after the other, the order rotated every round.
Times are rank 0's (median over a run's steps after the warm-up); the thread CPU time per step
(`time.thread_time`, less sensitive to the machine's load than the wall clock) is printed for
each rank. Ratio = a configuration's median over the no-tool median of the same round; the
figure is the median over rounds. The LAST printed line is one JSON object mapping each
config to its ratio over no tool (goal: <= 1.05 for the recommended config, <= 1.3 for
everything), and `ours_over_floor` to the monitor's ratio over its floor's.

    OMP_NUM_THREADS=1 python bench/megatron_overhead.py [--parallel tp|dp|ep] [--steps 40] [--warmup 5]
        [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tests.multiproc import run_ranks  # noqa: E402

EVERYTHING = {"watch": {"module_outputs": True, "module_inputs": True, "activation_grads": True,
                        "param_grads": True, "params": True,
                        "optimizer_state": ["exp_avg", "exp_avg_sq", "update", "ratio"]},
              "sinks": ["tensorboard"]}


CONFIGS = ("no tool", "floor megatron/monitor.yaml", "megatron/monitor.yaml", "floor everything", "everything")
#: the configurations with the monitor (each beside its floor)
MONITORED = ("megatron/monitor.yaml", "everything")


def _floor(model: Any, optimizer: Any, config: dict[str, Any]) -> Any:
    """bench/modes.py's floor for what `config` watches on this Megatron model: the same
    modules hooked (`modules.exclude_regex` left out), one sum per tensor, the step's sums
    all-reduced over the ranks in one collective, one transfer."""
    import torch.distributed as dist

    from modes import Floor

    from msprobe_engine.config import load_config

    excluded = [re.compile(pattern) for pattern in config.get("modules", {}).get("exclude_regex", [])]
    inner = optimizer.chained_optimizers[0].optimizer  # the torch Adam: its step hooks see the grads
    return Floor(model, inner, load_config(config).watch,
                 watched=lambda name: bool(name) and not any(p.search(name) for p in excluded),
                 merge=dist.all_reduce)


def rank_main(rank: int, world: int, parallel: str, name: str, steps: int, warmup: int, out: str
              ) -> tuple[float, float]:
    """One rank of configuration `name` (of `CONFIGS`): the median seconds of its steps after
    `warmup`, wall clock and thread CPU."""
    import torch

    from msprobe_engine.config.loader import read_file
    from msprobe_integrations.megatron import MegatronMonitor
    from tests import megatron_helpers as H

    torch.set_num_threads(1)
    H.init_parallel(tp=2 if parallel == "tp" else 1, ep=2 if parallel == "ep" else 1)
    spec = H.TinySpec(layers=4, hidden=128, heads=4, vocab=256, seq=64, batch=4, experts=4 if parallel == "ep" else 0)
    own_data = parallel in ("dp", "ep")  # each rank its own micro-batches
    model = H.wrap_ddp(H.build_gpt(spec), distributed_optimizer=parallel == "dp")
    optimizer = H.build_optimizer([model])
    monitor = floor = None
    if name != "no tool":
        watched = name.removeprefix("floor ")
        config = read_file(ROOT / "configs" / "megatron" / "monitor.yaml") if watched == "megatron/monitor.yaml" \
            else EVERYTHING
        if name.startswith("floor "):
            floor = _floor(model, optimizer, config)
        else:
            monitor = MegatronMonitor([model], optimizer,
                                      config={**config, "output_dir": str(Path(out) / name.replace("/", "_"))})
    times, cpu = [], []
    for i in range(steps + warmup):
        batches = H.micro_batches(spec, 2, seed=i * world + (rank if own_data else 0))
        start, start_cpu = time.perf_counter(), time.thread_time()
        if floor is not None:
            loss = floor.run(lambda: H.train_step(model, optimizer, batches)[0])
        else:
            loss, _, _ = H.train_step(model, optimizer, batches)
        if monitor is not None:
            monitor.step_end(loss)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
    if monitor is not None:
        monitor.close()
    return statistics.median(times), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", choices=["tp", "dp", "ep"], default="tp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="msprobe-megatron-bench-")
    ratios: dict[str, list[float]] = {name: [] for name in CONFIGS[1:]}
    for r in range(args.rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        runs = {name: run_ranks(rank_main, 2, args.parallel, name, args.steps, args.warmup,
                                str(Path(out) / f"round{r}"), timeout=1800) for name in order}
        base = runs["no tool"][0][0]
        for name in CONFIGS[1:]:
            ratios[name].append(runs[name][0][0] / base)
        print(f"round {r}: {args.parallel.upper()}=2, no tool {base * 1e3:.2f} ms a step; "
              + ", ".join(f"{name} x{ratios[name][-1]:.3f}" for name in CONFIGS[1:])
              + "; thread CPU per step (ranks 0, 1): "
              + ", ".join(f"{name} {' / '.join(f'{cpu * 1e3:.1f}' for _, cpu in runs[name])} ms" for name in CONFIGS),
              flush=True)
    result: dict[str, Any] = {name: round(statistics.median(values), 3) for name, values in ratios.items()}
    for name, ratio in result.items():
        print(f"{name:28s} x{ratio:.3f} (median of {args.rounds} rounds, {args.steps} steps each)")
    result["ours_over_floor"] = {name: round(result[name] / result[f"floor {name}"], 3) for name in MONITORED}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
