"""The demo: train a small GPT on synthetic data with the monitor on, inject a fault, report it.

    python -m examples.demo [--steps 100] [--inject-step 60] [--inject-layer layers.1.mlp.0]
                            [--inject nan|inf|spike|none] [--config configs/full.yaml]
                            [--output-dir DIR] [--run-name NAME] [--threads 1]

Runs on CPU in a few seconds; prints progress, which alert fired, where and when, the
incident it left (directory, first culprit, replay) and the command that shows the run in
TensorBoard. Without --config, a non-finite step is skipped (`action: skip`), so the
training survives the injected nan. Each run writes to <output dir>/<run name>/ (a
timestamp unless --run-name is given).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import sys
import time

import torch

from examples.tiny_gpt import TinyGPT, inject, synthetic_batches
from msprobe_engine.config import load_config
from msprobe_integrations.torch import TorchMonitor

DEFAULT_OUTPUT_DIR = "./demo_output"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--inject", choices=["nan", "inf", "spike", "none"], default="nan")
    parser.add_argument("--inject-step", type=int, default=60)
    parser.add_argument("--inject-layer", default="layers.1.mlp.0")
    parser.add_argument("--config", default=None, help="monitor config (default: the built-in defaults)")
    parser.add_argument("--output-dir", default=None,
                        help=f"where runs go (default: the config's output_dir, else {DEFAULT_OUTPUT_DIR})")
    parser.add_argument("--run-name", default=None, help="the run's directory name (default: a timestamp)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: fastest for this model)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.inject != "none":  # registered first, so the monitor sees the corrupted output
        inject(model, args.inject_layer, lambda: monitor.step, args.inject_step, args.inject)
    monitor = TorchMonitor(model, optimizer, demo_config(args))

    def train_step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = model(tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        monitor.report_loss(loss)  # before the optimizer step: the loss, too, can decide a skip
        optimizer.step()
        return loss.detach()

    start = time.perf_counter()
    every = max(1, args.steps // 5)
    for step, (tokens, targets) in enumerate(synthetic_batches(model.cfg, args.steps, seed=args.seed), 1):
        loss = monitor.run_step(train_step, tokens, targets)  # replayable if an alert starts
        monitor.step_end()
        if step % every == 0 or step == args.steps:  # the demo's own read of the loss, not the monitor's
            print(f"step {step}/{args.steps}  loss {loss.item():.4g}  {time.perf_counter() - start:.1f}s", flush=True)
    monitor.close()
    elapsed = time.perf_counter() - start
    print_summary(monitor, args, elapsed)
    return 0


def demo_config(args: argparse.Namespace):
    """The config file's (or the demo's: skip a non-finite step), with --output-dir and
    --run-name applied."""
    if args.config:
        config = load_config(args.config)
    else:
        config = load_config({"output_dir": DEFAULT_OUTPUT_DIR,
                              "alerts": [{"rule": "non_finite", "action": "skip"}, {"rule": "spike"}]})
    given = {key: value for key, value in (("output_dir", args.output_dir), ("run_name", args.run_name))
             if value is not None}
    return dataclasses.replace(config, **given)


def tensorboard_command(logdir: str) -> str:
    """The command that serves `logdir`, with the tools of the environment running the demo."""
    python = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") \
        else sys.executable
    return f"{shlex.quote(python)} -m msprobe_engine tensorboard --logdir {shlex.quote(logdir)}"


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
        steps = f"{event.steps} step{'' if event.steps == 1 else 's'}"
        print(f"alert: {event.rule} ended at step {event.step} after {steps}; last value {event.value:g}")
    print(f"\nrun: {os.path.abspath(monitor.run.root)}")
    # the output_dir, not the run's directory: TensorBoard labels the run with its name (<name>/rank0)
    print(f"see it in TensorBoard:  {tensorboard_command(os.path.abspath(monitor.config.output_dir))}")
    print(f"  (then open http://127.0.0.1:6006: the run is {monitor.run.name}/rank0, beside the other runs there)")
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
