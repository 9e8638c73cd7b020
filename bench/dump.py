"""Dump overhead next to the predecessor's, one process per configuration, and tensor-dump
throughput against plain torch.save.

Step time, measured as a user runs it: the predecessor-style LM (bench/models.py `small_lm`,
nn.MultiheadAttention blocks), AdamW, one thread, the whole step between start and stop with
every step dumped (statistics, its own dump config with ``step: []``). In a round each
configuration (no tool; ours L0, L1, mix; the predecessor's L0, L1, mix) trains in a process of
its own (`bench/suite.py`'s `run_interleaved`), the processes taking turns of `suite.BURST`
steps back to back, the first of each turn untimed, so a background writer's work lands in its
own configuration's steps and no other's. Ratio = median step time over the no-tool process's
median in the same round; the figure is the median over rounds. Goals: ours L0 / L1 / mix <= 1.3 / 2.0 / 2.5 and (ours - 1) <= 1/3 of
(predecessor - 1).

Tensor throughput: the demo model (examples/tiny_gpt.py) trains `--tensor-steps` steps with
and without an L0 tensor dump (every file written, `close()` included), and the very same
tensors (loaded back from the dump) are written with plain ``torch.save``. Ratio = torch.save
time / time the dump added to training (medians of three interleaved rounds); goal >= 0.95.
Both sides write the same files (one per tensor, the same bytes) from a synced page cache
(`os.sync()` before each timed part), after a warm-up dump; the CPU figure is the same ratio
in process CPU time (both threads of the dump), which holds up better under load.

The LAST printed line is one JSON object of ratios and the load average.

    OMP_NUM_THREADS=1 python bench/dump.py [--rounds 3] [--steps 40] [--warmup 5] [--tensor-steps 8]
        [--no-predecessor]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from examples.tiny_gpt import TinyGPT, synthetic_batches  # noqa: E402
from msprobe_engine.dump import PrecisionDebugger, iter_dump_tensors, load_dump  # noqa: E402
from suite import BURST, run_interleaved  # noqa: E402

LEVELS = ("L0", "L1", "mix")
CONFIGS = ("none", *(f"ours_dump_{lv}" for lv in LEVELS), *(f"pred_dump_{lv}" for lv in LEVELS))


def train_step(model: TinyGPT, opt: torch.optim.Optimizer, batch) -> None:
    loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def step_times(rounds: int, steps: int, warmup: int, configs: tuple[str, ...] = CONFIGS) -> dict[str, float]:
    """Median over rounds of each configuration's step-time ratio to the no-tool process: in a
    round, at least `steps` timed and `warmup` untimed steps of each."""
    ratios: dict[str, list[float]] = {c: [] for c in configs[1:]}
    turns, warmup_turns = -(-steps // (BURST - 1)), -(-warmup // BURST)
    for r in range(rounds):
        medians = run_interleaved("small_lm", list(configs), turns, warmup_turns, compiled=False)
        for c in configs[1:]:
            ratios[c].append(medians[c] / medians["none"])
        print(f"round {r}: no tool {medians['none'] * 1e3:.1f} ms/step; "
              + ", ".join(f"{c} {ratios[c][-1]:.2f}" for c in configs[1:]), flush=True)
    result = {c: statistics.median(v) for c, v in ratios.items()}
    if "pred_dump_L0" not in result:
        return result
    for lv in LEVELS:
        ours, pred = result[f"ours_dump_{lv}"], result[f"pred_dump_{lv}"]
        result[f"share_of_predecessor_{lv}"] = (ours - 1) / (pred - 1) if pred > 1 else float("nan")
        print(f"dump {lv:4s} ours {ours:5.2f}  predecessor {pred:5.2f}  (ours-1)/(pred-1) "
              f"{result[f'share_of_predecessor_{lv}']:.2f}")
    return result


def timed_training(steps: int, debugger: PrecisionDebugger | None) -> tuple[float, float]:
    """(wall, process CPU) seconds of `steps` training steps, the dump's `close()` included."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = list(synthetic_batches(model.cfg, steps))
    train_step(model, opt, batches[0])  # warm up allocator and kernels outside the timing
    os.sync()  # the previous part's file data is not written back inside this one's timing
    start, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        if debugger is None:
            train_step(model, opt, batch)
        else:
            with debugger.step_scope(model):
                train_step(model, opt, batch)
    if debugger is not None:
        debugger.close()
    return time.perf_counter() - start, time.process_time() - cpu


def timed_saving(tensors: list[tuple[str, torch.Tensor]], target: Path) -> tuple[float, float]:
    """(wall, process CPU) seconds of plain ``torch.save`` of `tensors`, one file each, in `target`."""
    target.mkdir()
    os.sync()
    start, cpu = time.perf_counter(), time.process_time()
    for name, tensor in tensors:
        torch.save(tensor, target / name)
    return time.perf_counter() - start, time.process_time() - cpu


def tensor_throughput(steps: int, out: Path, rounds: int = 3) -> dict[str, float]:
    """torch.save time over the time the dump added to training, wall and process CPU: medians
    over `rounds` interleaved rounds of training, training with the dump, torch.save. A dump
    before the rounds pays the one-time costs (imports, torch.save's first call) that the plain
    torch.save, run after it, never pays."""
    timed_training(1, PrecisionDebugger({"task": "tensor", "dump_path": str(out / "warmup"), "level": "L0"}))
    plain, dumped, saving = [], [], []
    for i in range(rounds):
        plain.append(timed_training(steps, None))
        debugger = PrecisionDebugger({"task": "tensor", "dump_path": str(out / f"tensor{i}"), "level": "L0"})
        dumped.append(timed_training(steps, debugger))
        tensors = [(ref.record["data_name"], torch.load(dump.tensor_file(ref), weights_only=True))
                   for dump in load_dump(out / f"tensor{i}").values()
                   for ref in iter_dump_tensors({"data": dump.data})]
        saving.append(timed_saving(tensors, out / f"plain{i}"))
        shutil.rmtree(out / f"tensor{i}")
        shutil.rmtree(out / f"plain{i}")
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    (plain_s, plain_c), (dumped_s, dumped_c), (saving_s, saving_c) = (
        [statistics.median(x[k] for x in v) for k in (0, 1)] for v in (plain, dumped, saving))
    print(f"tensor dump (L0): {len(tensors)} tensors, {total / 2**20:.1f} MiB in {steps} steps; training "
          f"{plain_s:.3f} s, with the dump {dumped_s:.3f} s (+{dumped_s - plain_s:.3f} s, CPU "
          f"+{dumped_c - plain_c:.3f} s); plain torch.save {saving_s:.3f} s (CPU {saving_c:.3f} s) "
          f"(medians of {rounds})")
    return {"tensor_throughput_vs_torch_save": saving_s / max(dumped_s - plain_s, 1e-9),
            "tensor_cpu_vs_torch_save": saving_c / max(dumped_c - plain_c, 1e-9)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tensor-steps", type=int, default=8)
    parser.add_argument("--no-predecessor", action="store_true",
                        help="ours only (no predecessor processes, no share_of_predecessor): quicker A/B runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp(prefix="msprobe-dump-bench-"))
    try:
        configs = tuple(c for c in CONFIGS if not (args.no_predecessor and c.startswith("pred_")))
        ratios = step_times(args.rounds, args.steps, args.warmup, configs)
        ratios.update(tensor_throughput(args.tensor_steps, out))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    report: dict = {k: round(v, 3) for k, v in ratios.items()}
    report["load"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
