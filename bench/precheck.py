"""Online pre-check cost on the training side, and the offline run_ut throughput.

Online: two copies of the demo model (examples/tiny_gpt.py) train side by side in one process,
one step of each in turn in a rotating order, at OMP_NUM_THREADS=1: no tool, and every step's
API calls sent to a checker (`msprobe-engine run_ut --online`, a separate process on
localhost). Ratio = median step time over the no-tool median; also the share of calls
dropped because the checker fell behind (the training never waits for it).

Offline: `run_ut` over an L1 tensor dump of one step of the same model; calls per second.

The LAST printed line is one JSON object.

    OMP_NUM_THREADS=1 python bench/precheck.py [--steps 20] [--warmup 3]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from examples.tiny_gpt import TinyGPT, synthetic_batches  # noqa: E402
from msprobe_engine.analysis.precheck.runner import run_ut  # noqa: E402
from msprobe_engine.dump import PrecisionDebugger  # noqa: E402
from msprobe_engine.frameworks.torch.precheck.online import OnlinePrecheck  # noqa: E402


def train_step(model: TinyGPT, opt: torch.optim.Optimizer, batch) -> None:
    loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def make_run(steps: int):
    torch.manual_seed(0)
    model = TinyGPT()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), synthetic_batches(model.cfg, steps)


def online(steps: int, warmup: int, out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    checker = subprocess.Popen([sys.executable, "-m", "msprobe_engine", "run_ut", "--online", "--port", "0",
                                "-o", str(out)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(checker.stdout.readline().split("127.0.0.1:")[1].split(";")[0])
        sender = OnlinePrecheck(port=port)
        runs = {"no tool": make_run(steps + warmup), "online": make_run(steps + warmup)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for i in range(steps + warmup):
            for name in names[i % 2:] + names[:i % 2]:
                model, opt, batches = runs[name]
                batch = next(batches)
                start = time.perf_counter()
                if name == "online":
                    sender.start()
                train_step(model, opt, batch)
                if name == "online":
                    sender.stop()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
        sender.close()
        total = sender.client.sent + sender.client.dropped
        checker.send_signal(signal.SIGTERM)
        checker.communicate(timeout=600)
    finally:
        if checker.poll() is None:
            checker.kill()
    base = statistics.median(times["no tool"])
    return {"online_step_ratio": round(statistics.median(times["online"]) / base, 3),
            "online_dropped_share": round(sender.client.dropped / max(total, 1), 3),
            "no_tool_step_ms": round(base * 1e3, 2)}


def offline(out: Path) -> dict[str, float]:
    model, opt, batches = make_run(1)
    debugger = PrecisionDebugger({"task": "tensor", "dump_path": str(out / "dump"), "level": "L1"})
    debugger.start(model)
    train_step(model, opt, next(batches))
    debugger.stop()
    debugger.step()
    debugger.close()
    start = time.perf_counter()
    reports = run_ut(out / "dump", out / "report")
    seconds = time.perf_counter() - start
    calls = len(reports[0].done)
    return {"offline_calls": calls, "offline_calls_per_s": round(calls / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {**online(args.steps, args.warmup, Path(tmp) / "online"), **offline(Path(tmp))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
