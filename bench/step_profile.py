"""Where a monitored step's time goes: training-thread CPU time by part, and the writer thread.

One model (bench/models.py), no tool and `ours_<config>` trained one after the other in this
process, at one thread; after warm-up steps (enough for the trend rule's window to fill) the
mean over `--steps` steps of `time.thread_time` around the step and around the monitor's
parts (wrappers installed before the monitor is built), and the CPU time of the process's
other threads over the same steps (the writer thread, and any thread a sink's library starts). Nested parts include what they call: a hook's figure
includes its `add_tensors`.

    OMP_NUM_THREADS=1 python bench/step_profile.py [--model small_lm] [--config full] [--steps 15]

Last line: one JSON object of the figures (ms per step).
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: (class path, method, label, phase it sets for the add_tensors inside it)
PARTS = (
    ("msprobe_engine.frameworks.torch.module_hooks.ModuleHooks", "_collect", "forward hooks", "forward"),
    ("msprobe_engine.frameworks.torch.optimizer_hooks.OptimizerHooks", "before_step", "optimizer pre-step reads",
     "pre-step"),
    ("msprobe_engine.frameworks.torch.optimizer_hooks.OptimizerHooks", "_read_after_step",
     "optimizer post-step reads", "post-step"),
    ("msprobe_engine.steps.pipeline.StepPipeline", "transfer", "step end: pack + transfer", None),
    ("msprobe_engine.steps.pipeline.StepPipeline", "evaluate", "step end: rules", None),
    ("msprobe_engine.steps.pipeline.StepPipeline", "_emit", "step end: record, sinks queued", None),
    ("msprobe_engine.steps.pipeline.StepPipeline", "_start_incidents", "step end: incidents", None),
    ("msprobe_engine.monitor.Monitor", "step_end", "step end: all", None),
)


def _install(spent: dict[str, float], tensors: dict[str, int]) -> None:
    import importlib

    from msprobe_engine.steps.measure import Measurer

    phase = ["backward (gradient hooks)"]

    def wrap(owner, name: str, label: str, sets: str | None) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            before, start = phase[0], time.thread_time()
            phase[0] = sets or before
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += time.thread_time() - start
                phase[0] = before
        setattr(owner, name, timed)

    for path, name, label, sets in PARTS:
        module, _, cls = path.rpartition(".")
        wrap(getattr(importlib.import_module(module), cls), name, label, sets)
    add = Measurer.add  # the monitor binds it as its `add_tensors` when built: patched before

    def add_tensors(self, keys, values, *args, **kwargs):
        start = time.thread_time()
        try:
            return add(self, keys, values, *args, **kwargs)
        finally:
            spent[f"add_tensors: {phase[0]}"] += time.thread_time() - start
            tensors[phase[0]] += len(values)
    Measurer.add = add_tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small_lm")
    parser.add_argument("--config", default="full", help="grads_optimizer, default or full")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=22)
    args = parser.parse_args()

    import torch

    import modes
    from models import build

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    spent: dict[str, float] = collections.defaultdict(float)
    tensors: dict[str, int] = collections.defaultdict(int)
    _install(spent, tensors)
    out = Path(tempfile.mkdtemp(prefix="msprobe-profile-"))
    step_ms = {}
    for name in ("none", f"ours_{args.config}"):
        model, forward = build(args.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(forward=forward, optimizer=optimizer):
            loss = forward()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            return loss
        mode = modes.make(name, model, optimizer, out / name)
        for _ in range(args.warmup):
            mode.run(step)
        monitor = getattr(mode, "monitor", None)
        if monitor is not None:
            monitor.writer.flush()
        process_start, thread_start = time.process_time(), time.thread_time()
        spent.clear()
        tensors.clear()
        times = []
        for _ in range(args.steps):
            start = time.thread_time()
            mode.run(step)
            times.append(time.thread_time() - start)
        step_ms[name] = statistics.mean(times) * 1e3
        if monitor is not None:
            monitor.writer.flush()
            others = (time.process_time() - process_start) - (time.thread_time() - thread_start)
            writer_ms = others / args.steps * 1e3
            parts = {label: seconds / args.steps * 1e3 for label, seconds in spent.items()}
            counts = {where: n / args.steps for where, n in tensors.items()}
        mode.close()
    ours = step_ms[f"ours_{args.config}"]
    print(f"{args.model} {args.config}: training-thread CPU per step, no tool {step_ms['none']:.1f} ms, "
          f"monitored {ours:.1f} ms (+{ours - step_ms['none']:.1f}); load {os.getloadavg()[0]:.2f}")
    for label in sorted(parts):
        print(f"  {label:46s} {parts[label]:7.2f} ms")
    for where in sorted(counts):
        print(f"  tensors measured, {where:28s} {counts[where]:7.0f}")
    print(f"  {'other threads CPU (writer, sinks)':46s} {writer_ms:7.2f} ms")
    print(json.dumps({"model": args.model, "config": args.config, "none_ms": round(step_ms["none"], 2),
                      "ours_ms": round(ours, 2), "parts_ms": {k: round(v, 2) for k, v in parts.items()},
                      "tensors": counts, "writer_ms": round(writer_ms, 2),
                      "load": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
