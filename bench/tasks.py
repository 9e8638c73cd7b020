"""Overhead of the debugger tasks on the demo model, and the predecessor's on the same model.

Ours: copies of the demo model (examples/tiny_gpt.py) train side by side in one process, one
step of each in turn in a rotating order, at OMP_NUM_THREADS=1: no tool, a statistics L1
dump (the capture every API task builds on), overflow_check L1 (clean steps: nothing
written), diff_check L1 against a statistics dump of the same run (no divergence), the
statistics dump with summary_mode xor and md5, grad_probe at L1 and L2, and free_benchmark
check (improve_precision, every API rerun in float64) and add_noise. Ratio = median step time
over the no-tool median.

The predecessor (mindstudio-probe 26.2.0) runs in a subprocess (its API wrappers are global),
its no-tool copy side by side: its statistics L1 dump. 26.2.0 has no overflow_check,
grad_probe or free_benchmark task for PyTorch, and its nan_check and diff_check need torch_npu,
so those tasks have no predecessor figure on this machine (reported as null).

The LAST printed line is one JSON object of ratios.

    OMP_NUM_THREADS=1 python bench/tasks.py [--steps 12] [--warmup 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
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

#: name -> config (None: no tool); dump_path is filled in per run
OURS = {
    "statistics_L1": {"task": "statistics", "level": "L1"},
    "overflow_check_L1": {"task": "overflow_check", "level": "L1"},
    "diff_check_L1": {"task": "diff_check", "level": "L1"},
    "xor_L1": {"task": "statistics", "level": "L1", "summary_mode": "xor"},
    "md5_L1": {"task": "statistics", "level": "L1", "summary_mode": "md5"},
    "grad_probe_L1": {"task": "grad_probe", "grad_probe": {"grad_level": "L1"}},
    "grad_probe_L2": {"task": "grad_probe", "grad_probe": {"grad_level": "L2"}},
    "free_benchmark_improve_precision": {"task": "free_benchmark"},
    "free_benchmark_add_noise": {"task": "free_benchmark", "free_benchmark": {"pert_mode": "add_noise"}},
}
#: our task -> the predecessor's figure it is shown next to
PREDECESSOR_OF = {"statistics_L1": "statistics_L1"}


def train_step(model: TinyGPT, opt: torch.optim.Optimizer, batch) -> None:
    loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _model():
    torch.manual_seed(0)
    model = TinyGPT()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _reference(out: Path, steps: int) -> Path:
    """A statistics L1 dump of the same training (diff_check's bench_path)."""
    from msprobe_engine.dump import PrecisionDebugger

    model, opt = _model()
    with PrecisionDebugger({"task": "statistics", "level": "L1", "dump_path": str(out / "reference")}) as d:
        for batch in synthetic_batches(model.cfg, steps):
            with d.step_scope(model):
                train_step(model, opt, batch)
    return out / "reference"


def _rotate(runs: dict, steps: int, warmup: int, step_fn) -> dict[str, float]:
    """Median step time per run, one step of each in turn, the order rotating."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(steps + warmup):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            step_fn(runs[name])
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def ours(steps: int, warmup: int, out: Path) -> dict[str, float]:
    from msprobe_engine.dump import PrecisionDebugger

    bench_path = _reference(out, steps + warmup)
    runs = {}
    for name, config in {"no tool": None, **OURS}.items():
        model, opt = _model()
        debugger = None
        if config is not None:
            config = {**config, "dump_path": str(out / name)}
            if config["task"] == "diff_check":
                config["diff_check"] = {"bench_path": str(bench_path)}
            debugger = PrecisionDebugger(config)
            if config["task"] == "grad_probe":
                debugger.monitor(model)
        runs[name] = (model, opt, debugger, synthetic_batches(model.cfg, steps + warmup))

    def step(run) -> None:
        model, opt, debugger, batches = run
        batch = next(batches)
        if debugger is None or debugger.config.task == "grad_probe":
            train_step(model, opt, batch)
            if debugger is not None:
                debugger.flush()  # the files of this optimizer step are written in its time
        else:
            with debugger.step_scope(model):
                train_step(model, opt, batch)
            debugger.flush()

    medians = _rotate(runs, steps, warmup, step)
    for _, _, debugger, _ in runs.values():
        if debugger is not None:
            debugger.close()
    for name, median in medians.items():
        print(f"ours         {name:34s} median step {median * 1e3:8.2f} ms")
    return {name: medians[name] / medians["no tool"] for name in OURS}


def predecessor(steps: int, warmup: int, out: Path) -> dict[str, float]:
    """The predecessor's statistics L1 dump next to its own no-tool copy (this script, --predecessor)."""
    from msprobe.pytorch import PrecisionDebugger

    config = out / "predecessor.json"
    config.write_text(json.dumps({"task": "statistics", "dump_path": str(out / "predecessor"), "rank": [],
                                  "step": [], "level": "L1", "async_dump": False,
                                  "statistics": {"scope": [], "list": [], "data_mode": ["all"],
                                                 "summary_mode": "statistics"}}))
    debugger = PrecisionDebugger(config_path=str(config))
    runs = {}
    for name in ("no tool", "statistics_L1"):
        model, opt = _model()
        runs[name] = (model, opt, debugger if name != "no tool" else None, synthetic_batches(model.cfg, steps + warmup))

    def step(run) -> None:
        model, opt, dbg, batches = run
        batch = next(batches)
        if dbg is None:
            train_step(model, opt, batch)
            return
        dbg.start(model)
        train_step(model, opt, batch)
        dbg.stop()
        dbg.step()

    medians = _rotate(runs, steps, warmup, step)
    for name, median in medians.items():
        print(f"predecessor  {name:34s} median step {median * 1e3:8.2f} ms")
    return {"statistics_L1": medians["statistics_L1"] / medians["no tool"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--predecessor", action="store_true", help=argparse.SUPPRESS)  # the subprocess
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp(prefix="msprobe-tasks-bench-"))
    try:
        if args.predecessor:
            print(json.dumps(predecessor(args.steps, args.warmup, out)))
            return
        ratios = ours(args.steps, args.warmup, out)
        done = subprocess.run([sys.executable, __file__, "--predecessor", "--steps", str(args.steps),
                               "--warmup", str(args.warmup)], capture_output=True, text=True, timeout=1800)
        theirs = {}
        if done.returncode == 0:
            print("\n".join(line for line in done.stdout.splitlines()[:-1] if line.startswith("predecessor")))
            theirs = json.loads(done.stdout.splitlines()[-1])
        else:
            print(f"predecessor run failed: {done.stderr.strip().splitlines()[-1:]}")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    result = {name: {"ours": round(ratio, 3), "predecessor": (round(theirs[PREDECESSOR_OF[name]], 3)
                                                               if PREDECESSOR_OF.get(name) in theirs else None)}
              for name, ratio in ratios.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
