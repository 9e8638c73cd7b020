"""Monitor overhead under DeepSpeed: ZeRO-2, 2 processes (gloo, CPU), OMP_NUM_THREADS=1.

Three copies of the demo model train side by side in each rank, one optimizer step
of each in turn, in a rotating order (so machine noise hits every config alike):
no monitor, configs/grads_optimizer.yaml and configs/full.yaml (activations and their
gradients, gradients, parameters, optimizer state, update and ratio, every step). The
LAST printed line is one JSON object with each config's median step time over no
monitor. Goals: full <= 1.3, grads+optimizer <= 1.1.

    OMP_NUM_THREADS=1 python bench/deepspeed_overhead.py [--steps 40] [--warmup 5]
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
os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from examples.deepspeed_train import DEFAULT_DS_CONFIG, init_distributed, load_ds_config  # noqa: E402
from examples.tiny_gpt import TinyGPT, synthetic_batches  # noqa: E402
from msprobe_engine.config.loader import read_file  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402

#: the ready monitor configs measured (output_dir replaced)
CONFIGS = {"grads+optimizer": ROOT / "configs" / "grads_optimizer.yaml", "full": ROOT / "configs" / "full.yaml"}


def rank_main(rank: int, world: int, steps: int, warmup: int, out: str) -> dict[str, list[float]]:
    """In each rank: build the engines, step them in turn, return the step times."""
    import deepspeed

    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    torch.set_num_threads(1)
    init_distributed()
    runs = {}
    for name in ["no monitor", *CONFIGS]:
        torch.manual_seed(0)
        model = TinyGPT()
        config = load_ds_config(DEFAULT_DS_CONFIG, train_micro_batch_size_per_gpu=model.cfg.batch)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                          config=config)
        monitor = None
        if name in CONFIGS:
            monitor = DeepSpeedMonitor(engine, config={**read_file(CONFIGS[name]),
                                                       "output_dir": str(Path(out) / name.replace("+", "_"))})
        batches = synthetic_batches(model.cfg, (steps + warmup) * engine.gradient_accumulation_steps(), seed=rank)
        runs[name] = (engine, monitor, batches, [])
    names = list(runs)
    for step in range(steps + warmup):
        for name in names[step % len(names):] + names[:step % len(names)]:
            engine, _, batches, times = runs[name]
            start = time.perf_counter()
            for _ in range(engine.gradient_accumulation_steps()):
                loss = engine(*next(batches))
                engine.backward(loss)
                engine.step()
            if step >= warmup:
                times.append(time.perf_counter() - start)
    for _, monitor, _, _ in runs.values():
        if monitor is not None:
            monitor.close()
    return {name: times for name, (_, _, _, times) in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="msprobe-ds-bench-")
    times = run_ranks(rank_main, 2, args.steps, args.warmup, out, timeout=1200.0,
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})[0]
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:>16}: median step {median * 1e3:7.2f} ms (rank 0, {len(times[name])} steps)")
    base = medians["no monitor"]
    print(json.dumps({name: round(medians[name] / base, 3) for name in CONFIGS}))


if __name__ == "__main__":
    main()
