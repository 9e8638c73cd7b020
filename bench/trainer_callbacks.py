"""Overhead of the HF Trainer callback: a random-init GPT-2 (examples/hf_trainer.py) trained
by the Trainer on CPU with OMP_NUM_THREADS=1, without the callback, with
configs/grads_optimizer.yaml and with configs/full.yaml, in rotating order for `--rounds`
rounds (so machine noise hits every config alike). A step's time is taken from
`on_step_begin` to `on_step_end` (gradient accumulation 2). The LAST printed line is one
JSON object: each config's median step time over no monitor.

    OMP_NUM_THREADS=1 python bench/trainer_callbacks.py [--steps 20] [--rounds 3]
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

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from examples.hf_trainer import tiny_gpt2, token_rows  # noqa: E402
from msprobe_engine.config.loader import read_file  # noqa: E402
from msprobe_integrations.hf import MonitorCallback  # noqa: E402

CONFIGS = {"grads+optimizer": ROOT / "configs" / "grads_optimizer.yaml", "full": ROOT / "configs" / "full.yaml"}
WARMUP = 3


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def run(name: str, steps: int, out: Path) -> list[float]:
    timer = StepTimer()
    callbacks = [timer]
    if name != "none":
        callbacks.insert(0, MonitorCallback(config={**read_file(CONFIGS[name]), "output_dir": str(out / name)}))
    args = TrainingArguments(output_dir=str(out / "trainer"), use_cpu=True, report_to=[], save_strategy="no",
                             disable_tqdm=True, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=steps, logging_steps=10 ** 6, learning_rate=1e-3)
    Trainer(model=tiny_gpt2(), args=args, train_dataset=token_rows(steps * 8), callbacks=callbacks).train()
    return timer.times[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    names = ["none", *CONFIGS]
    times: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                times[name] += run(name, args.steps, Path(tmp))
    base = statistics.median(times["none"])
    for name in names:
        print(f"{name}: median step {statistics.median(times[name]) * 1e3:.1f} ms")
    print(json.dumps({"load": os.getloadavg()[0], "median_step_ms_no_monitor": round(base * 1e3, 2),
                      **{name: round(statistics.median(times[name]) / base, 3) for name in CONFIGS}}))


if __name__ == "__main__":
    main()
