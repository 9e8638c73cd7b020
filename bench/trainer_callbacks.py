"""Overhead of the trainer callbacks next to the plain loop's: the same random-init GPT-2
(`examples.hf_trainer.tiny_gpt2`; by default 4 layers of width 256, 3.2M parameters, whose
step is ~9x the 0.1M-parameter one's, long next to the trainers' own per-step work and the
machine's noise; `--model tiny`: 2 layers of width 64), the same rows, 2 micro-batches of 4 rows of 32 tokens a step, AdamW, gradients
clipped at 1.0, on the CPU with OMP_NUM_THREADS=1, trained by a plain torch loop
(`TorchMonitor`), the HF Trainer and Lightning (their `MonitorCallback`), each without the
monitor, with configs/grads_optimizer.yaml and with configs/full.yaml.

Every (trainer, config) runs in a process of its own (a fresh interpreter: no hooks, caches or
allocator state shared), the processes of a round in rotating order, for `--rounds` rounds, so
that machine noise hits every configuration alike. A step's time runs from its first
micro-batch to its end (the monitor's step_end included); the first `--warmup` steps of each
process are dropped, and each process gives its median step. Within a round, a config's ratio
is its median over the same trainer's without the monitor, and its added cost the difference
in milliseconds. The LAST printed line is one JSON object: the load average, per trainer and
config the median over the rounds and the [min, max] across them of the step, the ratio and
the added milliseconds, and per trainer (each round against the plain loop's of that round):
`minus_plain`, its ratio minus the plain loop's (the goal: at most 0.05), and
`added_minus_plain`, its added milliseconds minus the plain loop's as a share of the plain
loop's step without the monitor (the same extra cost in each trainer: about 0).

`--alternate`: each config's process monitors every other step (`schedule.interval: 2`), and
the baseline of its monitored steps is its own unmonitored steps, interleaved with them: the
machine's load and the process's own speed (memory layout, allocator) hit both alike, which a
process per configuration cannot cancel on a shared machine. The unmonitored steps keep the
hooks installed (they return at once), so this measures what a monitored step adds.

`--clock thread` times each step by the training thread's CPU time (`time.thread_time`) instead
of the wall clock: other processes' load and the monitor's writer thread are left out, so the
figure survives a shared machine (what a step costs the training thread). `--model gpt2-10m`
(6 layers of width 384, 10.8M parameters) makes the step ~3x longer still.

    OMP_NUM_THREADS=1 python bench/trainer_callbacks.py [--steps 10] [--rounds 3] [--trainers hf lightning]
    OMP_NUM_THREADS=1 python bench/trainer_callbacks.py --alternate --steps 16
    OMP_NUM_THREADS=1 python bench/trainer_callbacks.py --alternate --clock thread --steps 24 --rounds 6 --budget 540
    python bench/trainer_callbacks.py --one hf full    # one process: its step times and whether monitored, as JSON
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
from typing import Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRAINERS = ("plain", "hf", "lightning")
CONFIGS = ("none", "grads_optimizer", "full")
GAS, ROWS, LR = 2, 4, 1e-3
#: the GPT-2 sizes (`tiny_gpt2`'s arguments) of `--model`
MODELS = {"gpt2-3m": {"n_layer": 4, "n_embd": 256, "n_head": 4}, "gpt2-10m": {"n_layer": 6, "n_embd": 384, "n_head": 6},
          "tiny": {}}
#: `--clock`: wall time, or the CPU time of the training thread (the monitor's writer thread and
#: other processes left out: a figure that survives a loaded machine)
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
CLOCK = [time.perf_counter]  # the clock this process times its steps with


def monitor_config(name: str, out: Path, interval: int = 1) -> dict:
    """configs/<name>.yaml writing to `out`, monitoring every `interval`-th step."""
    from msprobe_engine.config.loader import read_file

    config = read_file(ROOT / "configs" / f"{name}.yaml")
    return {**config, "output_dir": str(out), "schedule": {**config.get("schedule", {}), "interval": interval}}


def plain(config: dict | None, steps: int, sizes: dict) -> list[tuple[float, bool]]:
    import torch

    from examples.hf_trainer import tiny_gpt2, token_rows
    from msprobe_integrations.torch import TorchMonitor

    model = tiny_gpt2(**sizes).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    monitor = TorchMonitor(model, optimizer, config=config) if config is not None else None
    rows = token_rows(steps * GAS * ROWS)
    batches = [{k: torch.stack([r[k] for r in rows[i:i + ROWS]]) for k in rows[0]} for i in range(0, len(rows), ROWS)]
    times = []
    for step in range(steps):
        monitored = monitor is not None and monitor.active
        start = CLOCK[0]()
        total = 0.0
        for batch in batches[step * GAS:(step + 1) * GAS]:
            loss = model(**batch).loss / GAS
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if monitor is not None:
            monitor.step_end(total)
        times.append((CLOCK[0]() - start, monitored))
    if monitor is not None:
        monitor.close()
    return times


def hf(config: dict | None, steps: int, sizes: dict, out: Path) -> list[tuple[float, bool]]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from examples.hf_trainer import tiny_gpt2, token_rows
    from msprobe_integrations.hf import MonitorCallback

    class StepTimer(TrainerCallback):
        def __init__(self, callback: MonitorCallback | None) -> None:
            self.callback = callback
            self.times: list[tuple[float, bool]] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.monitored = self.callback is not None and self.callback.monitor.active
            self.start = CLOCK[0]()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append((CLOCK[0]() - self.start, self.monitored))

    callback = MonitorCallback(config=config) if config is not None else None
    timer = StepTimer(callback)
    callbacks = [timer] if callback is None else [callback, timer]
    args = TrainingArguments(output_dir=str(out / "trainer"), use_cpu=True, report_to=[], save_strategy="no",
                             disable_tqdm=True, per_device_train_batch_size=ROWS, gradient_accumulation_steps=GAS,
                             max_steps=steps, logging_steps=10 ** 6, learning_rate=LR, max_grad_norm=1.0,
                             optim="adamw_torch", dataloader_num_workers=0)
    Trainer(model=tiny_gpt2(**sizes), args=args, train_dataset=token_rows(steps * GAS * ROWS), callbacks=callbacks).train()
    return timer.times


def lightning(config: dict | None, steps: int, sizes: dict, out: Path) -> list[tuple[float, bool]]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from examples.hf_trainer import token_rows
    from examples.lightning_train import lit_gpt2
    from msprobe_integrations.lightning import MonitorCallback

    class StepTimer(pl.Callback):
        def __init__(self, callback: MonitorCallback | None) -> None:
            self.callback = callback
            self.times: list[tuple[float, bool]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % GAS == 0:
                self.monitored = self.callback is not None and self.callback.monitor.active
                self.start = CLOCK[0]()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx % GAS == GAS - 1:
                self.times.append((CLOCK[0]() - self.start, self.monitored))

    callback = MonitorCallback(config=config) if config is not None else None
    timer = StepTimer(callback)
    callbacks = [timer] if callback is None else [callback, timer]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=GAS,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(out / "lightning"), callbacks=callbacks)
    trainer.fit(lit_gpt2(LR, **sizes), DataLoader(token_rows(steps * GAS * ROWS), batch_size=ROWS))
    return timer.times


def one(trainer: str, config: str, steps: int, model: str, interval: int = 1) -> list[tuple[float, bool]]:
    """The step times of one (trainer, config), in this process, each with whether the monitor
    measured that step (`interval`: the schedule's, 2 for every other step)."""
    with tempfile.TemporaryDirectory() as tmp:
        monitor = None if config == "none" else monitor_config(config, Path(tmp) / "monitor", interval)
        if trainer == "plain":
            return plain(monitor, steps, MODELS[model])
        return (hf if trainer == "hf" else lightning)(monitor, steps, MODELS[model], Path(tmp))


def spread(values: list[float], digits: int) -> dict:
    """The median of `values` and their [min, max], rounded."""
    return {"median": round(statistics.median(values), digits), "range": [round(min(values), digits),
                                                                          round(max(values), digits)]}


def summary(medians: dict[tuple[str, str], list[float]], bases: dict[tuple[str, str], list[float]],
            trainers: list[str], configs: Sequence[str]) -> dict:
    """Per trainer and config, from each round's median step (seconds, `medians`) and its
    baseline's (`bases`: the trainer without the monitor, or the same process's unmonitored
    steps): the step, the ratio and the added milliseconds, round by round; per trainer the same
    rounds against the plain loop's (the added milliseconds as a share of the plain loop's
    baseline step)."""
    rounds = range(len(medians["plain", configs[0]]))
    ratio = {run: [medians[run][r] / bases[run][r] for r in rounds] for run in medians}
    added = {run: [(medians[run][r] - bases[run][r]) * 1e3 for r in rounds] for run in medians}
    result: dict = {}
    for trainer in trainers:
        result[trainer] = {}
        for config in configs:
            run, plain_run = (trainer, config), ("plain", config)
            result[trainer][config] = {"step_ms": spread([m * 1e3 for m in medians[run]], 1),
                                       "base_ms": spread([m * 1e3 for m in bases[run]], 1),
                                       "ratio": spread(ratio[run], 3), "added_ms": spread(added[run], 1)}
            if trainer != "plain":
                result[trainer][config]["minus_plain"] = spread(
                    [ratio[run][r] - ratio[plain_run][r] for r in rounds], 3)
                result[trainer][config]["added_minus_plain"] = spread(
                    [(added[run][r] - added[plain_run][r]) / (bases[plain_run][r] * 1e3) for r in rounds], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps of each process left out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=MODELS, default="gpt2-3m")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS),
                        help="the trainers to compare (the plain loop is always one)")
    parser.add_argument("--alternate", action="store_true",
                        help="monitor every other step, each step's baseline the unmonitored steps of its process")
    parser.add_argument("--budget", type=float, default=0,
                        help="seconds: no round is started that would end past them (0: all rounds)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="time steps by the wall clock or by the training thread's CPU time")
    parser.add_argument("--one", nargs=2, metavar=("TRAINER", "CONFIG"), help="run one configuration here")
    parser.add_argument("--interval", type=int, default=1, help=argparse.SUPPRESS)  # (--one's schedule)
    args = parser.parse_args()
    CLOCK[0] = CLOCKS[args.clock]
    if args.one:
        print(json.dumps(one(*args.one, args.steps, args.model, args.interval)))
        return
    trainers = ["plain", *(t for t in args.trainers if t != "plain")]
    configs = CONFIGS[1:]
    runs = [(t, c) for t in trainers for c in (configs if args.alternate else CONFIGS)]
    medians: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    unmonitored: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    loads = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    done_rounds = 0
    for round_ in range(args.rounds):
        per_round = (time.perf_counter() - began) / max(done_rounds, 1)
        if args.budget and done_rounds and per_round * (done_rounds + 1) > args.budget:
            break  # another round would pass the time budget
        shift = round_ * 4 % len(runs)  # the order rotates by a trainer and a config each round
        for trainer, config in runs[shift:] + runs[:shift]:
            loads.append(os.getloadavg()[0])
            command = [sys.executable, __file__, "--one", trainer, config, "--steps", str(args.steps),
                       "--model", args.model, "--clock", args.clock, "--interval", "2" if args.alternate else "1"]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            steps = json.loads(done.stdout.strip().splitlines()[-1])[args.warmup:]
            medians[trainer, config].append(statistics.median(t for t, monitored in steps if monitored
                                                              or config == "none"))
            if args.alternate:
                unmonitored[trainer, config].append(statistics.median(t for t, monitored in steps if not monitored))
        done_rounds += 1
        print(f"round {round_ + 1}: " + ", ".join(f"{t} {c} {medians[t, c][-1] * 1e3:.1f} ms" for t, c in runs),
              flush=True)
    bases = unmonitored if args.alternate else {(t, c): medians[t, "none"] for t, c in runs}
    result = {"load": [round(min(loads), 1), round(max(loads), 1)], "model": args.model, "steps": args.steps,
              "warmup": args.warmup, "rounds": done_rounds, "alternate": args.alternate, "clock": args.clock,
              **summary({run: medians[run] for run in runs if run[1] != "none"}, bases, trainers, configs)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
