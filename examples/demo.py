"""The demo: train a small GPT on synthetic data with the monitor on, inject a fault, report it.

    python -m examples.demo [--steps 100] [--inject-step 60] [--inject-layer layers.1.mlp.0]
                            [--inject nan|inf|spike|none] [--config configs/full.yaml]

Runs on CPU in well under a minute; prints which alert fired, where and when,
the incident it left (directory, first culprit, replay) and the
`tensorboard --logdir` line to look at the run. Without --config, a non-finite
step is skipped (`action: skip`), so the training survives the injected nan.
"""
from __future__ import annotations

import argparse
import json
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
    config = args.config or {"output_dir": args.output_dir,
                             "alerts": [{"rule": "non_finite", "action": "skip"}, {"rule": "spike"}]}
    monitor = TorchMonitor(model, optimizer, config)

    def train_step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
        loss = model(tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        monitor.report_loss(loss)  # before the optimizer step: the loss, too, can decide a skip
        optimizer.step()

    start = time.perf_counter()
    for tokens, targets in synthetic_batches(model.cfg, args.steps, seed=args.seed):
        monitor.run_step(train_step, tokens, targets)  # replayable if an alert starts
        monitor.step_end()
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
    print_incidents(monitor)


def print_incidents(monitor) -> None:
    """The incident directories and what incident.json says about the first culprit."""
    recorder = monitor.incidents
    for incident in recorder.incidents if recorder is not None else []:
        print(f"\nincident: {os.path.abspath(incident.directory)}")
        report = incident.directory / "incident.json"
        if not report.is_file():
            print("  (not written: see the log)")
            continue
        found = json.loads(report.read_text())
        culprit = found["culprit"]
        if culprit is None or culprit["call"] is None:
            print(f"  culprit: none among the watched modules; first bad: {culprit and culprit['first_bad']}")
        else:
            print(f"  culprit: {culprit['call']} ({culprit['module_class']}, {culprit['phase']}): {culprit['method']}")
        print(f"  action: {found['action']}; replay: {found['replay']['status']} ({found['replay']['detail']})")


if __name__ == "__main__":
    raise SystemExit(main())
