"""Dump overhead on the demo model, and tensor-dump throughput against plain torch.save.

Step time: four copies of the demo model (examples/tiny_gpt.py) train side by side in one
process, one step of each in turn in a rotating order (machine noise hits every config
alike), at OMP_NUM_THREADS=1: no tool, and L0, L1 and mix statistics dumps of every step
(start/stop/step around each step, dump.json written by the writer thread). Ratio = median
step time over the no-tool median. Goals: L0 <= 1.3, L1 <= 2.0, mix <= 2.5.

Tensor throughput: the same model trains `--tensor-steps` steps with and without an L0
tensor dump (the time to write every file included, `close()`), and the very same tensors
(loaded back from the dump) are written with plain ``torch.save``. Ratio = torch.save time
/ time the dump added to training (medians of three interleaved rounds); goal >= 0.7.

The LAST printed line is one JSON object of ratios.

    OMP_NUM_THREADS=1 python bench/dump.py [--steps 40] [--warmup 5] [--tensor-steps 8]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from examples.tiny_gpt import TinyGPT, synthetic_batches  # noqa: E402
from msprobe_engine.dump import PrecisionDebugger, iter_dump_tensors, load_dump  # noqa: E402

LEVELS = ("L0", "L1", "mix")


def train_step(model: TinyGPT, opt: torch.optim.Optimizer, batch) -> None:
    loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def make_run(level: str | None, out: Path, steps: int):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    debugger = None
    if level is not None:
        debugger = PrecisionDebugger({"task": "statistics", "dump_path": str(out / level), "level": level})
    return model, opt, debugger, synthetic_batches(model.cfg, steps)


def step_times(steps: int, warmup: int, out: Path) -> dict[str, float]:
    runs = {name: make_run(None if name == "no tool" else name, out, steps + warmup)
            for name in ("no tool", *LEVELS)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(steps + warmup):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            model, opt, debugger, batches = runs[name]
            batch = next(batches)
            start = time.perf_counter()
            if debugger is None:
                train_step(model, opt, batch)
            else:
                with debugger.step_scope(model):
                    train_step(model, opt, batch)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    for _, _, debugger, _ in runs.values():
        if debugger is not None:
            debugger.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:8s} median step {median * 1e3:7.2f} ms")
    return {name: medians[name] / medians["no tool"] for name in LEVELS}


def timed_training(steps: int, debugger: PrecisionDebugger | None) -> float:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = list(synthetic_batches(model.cfg, steps))
    train_step(model, opt, batches[0])  # warm up allocator and kernels outside the timing
    start = time.perf_counter()
    for batch in batches:
        if debugger is None:
            train_step(model, opt, batch)
        else:
            with debugger.step_scope(model):
                train_step(model, opt, batch)
    if debugger is not None:
        debugger.close()
    return time.perf_counter() - start


def tensor_throughput(steps: int, out: Path, rounds: int = 3) -> float:
    """Median over `rounds` interleaved rounds of: training, training with the dump, torch.save."""
    plain, dumped, saving = [], [], []
    for i in range(rounds):
        plain.append(timed_training(steps, None))
        debugger = PrecisionDebugger({"task": "tensor", "dump_path": str(out / f"tensor{i}"), "level": "L0"})
        dumped.append(timed_training(steps, debugger))
        tensors = [(ref.record["data_name"], torch.load(dump.tensor_file(ref), weights_only=True))
                   for dump in load_dump(out / f"tensor{i}").values()
                   for ref in iter_dump_tensors({"data": dump.data})]
        target = out / f"plain{i}"
        target.mkdir()
        start = time.perf_counter()
        for name, tensor in tensors:
            torch.save(tensor, target / name)
        saving.append(time.perf_counter() - start)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    plain_s, dumped_s, saving_s = (statistics.median(v) for v in (plain, dumped, saving))
    added = dumped_s - plain_s
    print(f"tensor dump (L0): {len(tensors)} tensors, {total / 2**20:.1f} MiB in {steps} steps; training "
          f"{plain_s:.3f} s, with the dump {dumped_s:.3f} s (+{added:.3f} s); plain torch.save {saving_s:.3f} s "
          f"(medians of {rounds})")
    return saving_s / max(added, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tensor-steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp(prefix="msprobe-dump-bench-"))
    try:
        ratios = step_times(args.steps, args.warmup, out)
        ratios["tensor_throughput_vs_torch_save"] = tensor_throughput(args.tensor_steps, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({k: round(v, 3) for k, v in ratios.items()}))


if __name__ == "__main__":
    main()
