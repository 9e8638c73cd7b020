"""The demo: train a small GPT on synthetic data with the monitor on, inject a fault, report it.

    python -m examples.demo [--steps 100] [--inject-step 60] [--inject-layer layers.1.mlp.0]
                            [--inject nan|inf|spike|none] [--config configs/full.yaml]

Runs on CPU in well under a minute; prints which alert fired, where and when,
and the `tensorboard --logdir` line to look at the run.
"""
from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from examples.tiny_gpt import TinyGPT, inject, synthetic_batches
from msprobe_integrations.torch import TorchMonitor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--inject", choices=["nan", "inf", "spike", "none"], default="nan")
    parser.add_argument("--inject-step", type=int, default=60)
    parser.add_argument("--inject-layer", default="layers.1.mlp.0")
    parser.add_argument("--config", default=None, help="monitor config (default: the built-in defaults)")
    parser.add_argument("--output-dir", default="./demo_output")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.manual_seed(args.seed)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.inject != "none":  # registered first, so the monitor sees the corrupted output
        inject(model, args.inject_layer, lambda: monitor.step, args.inject_step, args.inject)
    config = args.config or {"output_dir": args.output_dir}
    monitor = TorchMonitor(model, optimizer, config)
    start = time.perf_counter()
    for tokens, targets in synthetic_batches(model.cfg, args.steps, seed=args.seed):
        loss = model(tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        monitor.step_end(loss)
    monitor.close()
    elapsed = time.perf_counter() - start
    print_summary(monitor, args, elapsed)
    return 0


def print_summary(monitor, args: argparse.Namespace, elapsed: float) -> None:
    records = list(monitor.history)
    last_loss = records[-1].metrics.get("train/loss") if records else float("nan")
    print(f"\ntrained {args.steps} steps in {elapsed:.1f}s; last loss {last_loss:.4g}; "
          f"{monitor.transfers} host transfers; {monitor.records_written} records written")
    events = list(monitor.alert_log)
    if args.inject != "none":
        print(f"injected: {args.inject} into {args.inject_layer} at step {args.inject_step}")
    starts = [e for e in events if e.phase == "start"]
    if not starts:
        print("alerts: none")
    for event in starts:
        print(f"alert: {event.rule} started at step {event.step}: {event.tag} = {event.value:g}")
    for event in (e for e in events if e.phase == "end"):
        print(f"alert: {event.rule} ended at step {event.step} after {event.steps} steps")
    print(f"\nsee the run:  tensorboard --logdir {os.path.abspath(monitor.config.output_dir)}")


if __name__ == "__main__":
    raise SystemExit(main())
