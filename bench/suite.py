"""Monitor and dump overhead on models we did not write, side by side with the predecessor.

For each model (bench/models.py), every mode (bench/modes.py) trains its own copy of the
model in a process of its own (`serve`), at one thread: no mode's background thread (the
monitor's writer, a dump's) runs in another's process. The processes take turns, a few steps
back to back a turn (`BURST`, the first of each turn untimed), the order rotated every round
(machine noise hits every mode alike; `run_interleaved`). Ratio = median step time of a mode
over the median of `none`. Dumps are measured on the predecessor-style model (`small_lm`).

Printed: one table per model, then, as the LAST line, one JSON object:
``{model: {mode: ratio, ..., "ratio_to_floor": {config: ours / floor},
"share_of_predecessor": {config: (ours - 1) / (pred - 1)}}, "load": [1, 5, 15 min]}``.

    OMP_NUM_THREADS=1 python bench/suite.py [--quick] [--models small_lm gpt2-1m ...]
        [--steps N] [--warmup N] [--compiled [--configs ...] [--no-predecessor]]

`--compiled` [--configs ...]: every model compiled in place (`model.compile()`, inductor; a process
a mode matters doubly there: a second instance in a process would reuse the first one's graphs), a
`none` process beside each config's (and, for `COMPILED_FLOORS`, the config's floor), taking
turns as above; ratio = ours over that `none` (wall clock; `cpu_ratio`: the processes' CPU time); the graph
breaks and graphs of each first step are reported too (docs/compile.md). The predecessor's
monitor (`pred_<config>`) runs compiled the same way, in a process of its own beside a `none` of
its own (it patches torch globally); where it cannot, its error is reported instead of its ratio
(`--no-predecessor` leaves it out). The floors of configs with module hooks are not run compiled
(their plain Python hooks would break the graph). The last line's JSON is then
``{model: {config: {"ours": {"ratio", "cpu_ratio", "graph_breaks", "graphs", ...}, "floor": {...}
(`COMPILED_FLOORS`), "pred": {...} or {"error": ...}}}, "load": [...]}``.
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
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modes import CONFIGS  # noqa: E402

SMALL = ("small_lm", "gpt2-1m", "llama-1m")
MEDIUM = ("gpt2-20m", "llama-20m")
OURS = [f"ours_{c}" for c in CONFIGS]
FLOORS = [f"floor_{c}" for c in CONFIGS]
LEVELS = ("L0", "L1", "mix")
#: what starts a reply line of a `serve` process
REPLY = "@@"
#: configs whose floor runs compiled: no module hooks (the floor's forward hooks, plain Python
#: appending to a list, would break the graph: that would be no floor)
COMPILED_FLOORS = ("grads_optimizer",)
#: steps a `serve` process runs back to back a turn (`run_interleaved`)
BURST = 4


def eager_modes(model: str) -> list[str]:
    """The modes of one model, each trained in a process of its own."""
    modes = ["none", *FLOORS, *OURS, *(f"pred_{c}" for c in CONFIGS)]
    if model == "small_lm":
        modes += [f"{tool}_dump_{level}" for tool in ("ours", "pred") for level in LEVELS]
    return modes


def serve(model_name: str, mode_name: str, compiled: bool) -> None:
    """One mode of one model (`compiled`: compiled in place), stepped on request (`--serve`): prints
    its first step's graph breaks and graphs as JSON, then for each "steps K" line read from stdin
    runs K steps back to back and replies with the seconds of each (wall clock, then the process's
    CPU time); each reply on a line of its own after `REPLY` (the predecessor logs to stdout too)."""
    import logging

    import torch

    import modes as mode_lib
    from models import build

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    model, forward = build(model_name)
    if compiled:
        model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss = forward()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss
    mode = mode_lib.make(mode_name, model, optimizer, Path(tempfile.mkdtemp(prefix="msprobe-suite-")))
    counters = torch._dynamo.utils.counters
    mode.run(step)
    print(REPLY, json.dumps({"graph_breaks": sum(counters["graph_break"].values()),
                             "graphs": counters["stats"]["unique_graphs"]}), flush=True)
    for line in sys.stdin:
        word, _, count = line.partition(" ")
        if word != "steps":
            break
        for _ in range(int(count)):
            start, cpu = time.perf_counter(), time.process_time()
            mode.run(step)
            print(REPLY, time.perf_counter() - start, time.process_time() - cpu, flush=True)
    mode.close()


def _reply(proc: subprocess.Popen) -> str | None:
    """The next reply of a `serve` process (other lines skipped), or None when it exited."""
    for line in proc.stdout:
        if line.startswith(REPLY):
            return line[len(REPLY):]
    return None


def run_interleaved(model: str, modes: list[str], steps: int, warmup: int, compiled: bool = True) -> dict[str, float]:
    """Each mode in a process of its own (`serve`), stepped in turn, `BURST` steps back to back a
    turn, the order rotated every round: the median seconds of each (wall clock; `<mode>:cpu` its
    process's CPU time) over the steps after the first of each burst, and its first step's graph
    breaks and graphs. `steps` and `warmup` count rounds. A worker that exits raises RuntimeError
    with its stderr's end.

    Bursts, because a process's background work (the monitor's writer thread: its sinks) runs while
    its training thread steps on, taking the GIL from it, as in a real run; one step a turn would
    leave that work to the idle time while the other process steps (llama-1m full compiled: 1.6
    instead of 1.9). The first step of a burst follows such a pause, so it is not timed."""
    errors = {m: tempfile.TemporaryFile("w+") for m in modes}
    command = [sys.executable, __file__, "--serve", model, *(["--compiled"] if compiled else [])]
    procs = {m: subprocess.Popen([*command, "--modes", m], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=errors[m], text=True) for m in modes}
    result: dict[str, float] = {}
    try:
        for m, proc in procs.items():
            line = _reply(proc)
            if line is None:
                code = proc.wait()
                errors[m].seek(0)
                raise RuntimeError(f"{model} {m}: the worker exited (exit {code}): {errors[m].read()[-1500:]}")
            result.update({f"{m}:{k}": v for k, v in json.loads(line).items()})
        times: dict[str, list[float]] = {key: [] for m in modes for key in (m, f"{m}:cpu")}
        for i in range(warmup + steps):
            shift = i % len(modes)
            for m in modes[shift:] + modes[:shift]:
                procs[m].stdin.write(f"steps {BURST}\n")
                procs[m].stdin.flush()
                replies = [map(float, _reply(procs[m]).split()) for _ in range(BURST)]
                if i >= warmup:
                    for wall, cpu in replies[1:]:
                        times[m].append(wall)
                        times[f"{m}:cpu"].append(cpu)
    finally:
        for m, proc in procs.items():
            proc.stdin.close()
            proc.wait()
            errors[m].close()
    return {**result, **{m: statistics.median(t) for m, t in times.items()}}


def summarise(model: str, medians: dict[str, float]) -> dict:
    """Ratios over `none` (`run_interleaved`'s medians), and the derived figures."""
    ratios = {m: round(t / medians["none"], 3) for m, t in medians.items() if m != "none" and ":" not in m}
    result = dict(ratios)
    result["ratio_to_floor"] = {c: round(ratios[f"ours_{c}"] / ratios[f"floor_{c}"], 3) for c in CONFIGS}
    pairs = [(c, f"ours_{c}", f"pred_{c}") for c in CONFIGS]
    pairs += [(f"dump_{lv}", f"ours_dump_{lv}", f"pred_dump_{lv}") for lv in LEVELS if f"ours_dump_{lv}" in ratios]
    result["share_of_predecessor"] = {name: round((ratios[o] - 1) / (ratios[p] - 1), 3)
                                      for name, o, p in pairs if ratios[p] > 1}
    base = medians["none"]
    print(f"== {model}: no tool {base * 1e3:.1f} ms/step")
    for c in CONFIGS:
        print(f"  {c:16s} floor {ratios[f'floor_{c}']:6.3f}  ours {ratios[f'ours_{c}']:6.3f}  "
              f"predecessor {ratios[f'pred_{c}']:6.3f}  ours/floor {result['ratio_to_floor'][c]:.3f}")
    for lv in LEVELS:
        if f"ours_dump_{lv}" in ratios:
            print(f"  dump {lv:11s} ours {ratios[f'ours_dump_{lv}']:6.3f}  "
                  f"predecessor {ratios[f'pred_dump_{lv}']:6.3f}")
    return result


def run_compiled(model: str, config: str, steps: int, warmup: int, predecessor: bool) -> dict:
    """Ours with the floor of `config` beside it (`COMPILED_FLOORS`), and (with `predecessor`) the predecessor's
    monitor, on the compiled `model`, each group beside a `none` process of its own: their
    `compiled_ratios`; the predecessor's as ``{"error": ...}`` where its worker exits."""
    floor = [f"floor_{config}"] if config in COMPILED_FLOORS else []
    medians = run_interleaved(model, ["none", *floor, f"ours_{config}"], steps, warmup)
    result = {"ours": compiled_ratios(medians, f"ours_{config}"), **{"floor": compiled_ratios(medians, m) for m in floor}}
    if predecessor:
        try:
            medians = run_interleaved(model, ["none", f"pred_{config}"], steps, warmup)
        except RuntimeError as exc:
            result["pred"] = {"error": str(exc)}
        else:
            result["pred"] = compiled_ratios(medians, f"pred_{config}")
    return result


def compiled_ratios(group: dict[str, float], mode: str) -> dict:
    """`mode`'s ratio over its process pair's compiled `none` (wall clock, and `cpu_ratio` of the
    processes' CPU time, which a loaded machine's waits for a core leave out), with the graph
    breaks and graphs of the first step of each (without the tool / with it)."""
    return {"ratio": round(group[mode] / group["none"], 3), "cpu_ratio": round(group[f"{mode}:cpu"] / group["none:cpu"], 3),
            "graph_breaks": group[f"{mode}:graph_breaks"], "graphs": group[f"{mode}:graphs"],
            "graph_breaks_none": group["none:graph_breaks"], "graphs_none": group["none:graphs"],
            "none_ms": round(group["none"] * 1e3, 1)}


def print_compiled(model: str, result: dict[str, dict]) -> None:
    """One line per config and tool of `run_compiled`'s results."""
    print(f"== {model} compiled")
    for config, tools in result.items():
        for tool, figures in tools.items():
            if "error" in figures:
                print(f"  {config:16s} {tool:5s} cannot run: {figures['error'][-300:]}")
                continue
            print(f"  {config:16s} {tool:5s} {figures['ratio']:6.3f}  cpu {figures['cpu_ratio']:6.3f}  "
                  f"graph breaks {figures['graph_breaks']} (none {figures['graph_breaks_none']})  "
                  f"graphs {figures['graphs']} (none {figures['graphs_none']})  no tool {figures['none_ms']} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models only, few steps (a correctness run)")
    parser.add_argument("--models", nargs="+", help=f"default: {' '.join(SMALL + MEDIUM)}")
    parser.add_argument("--steps", type=int, help=f"timed rounds, {BURST - 1} timed steps a mode each "
                        "(default 10 small, 5 medium; quick 2)")
    parser.add_argument("--warmup", type=int, help="untimed rounds first (default 2; quick 1)")
    parser.add_argument("--compiled", action="store_true", help="the models compiled (inductor), ours against none")
    parser.add_argument("--modes", help=argparse.SUPPRESS)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, help="--compiled: these configs only")
    parser.add_argument("--no-predecessor", action="store_true", help="--compiled: ours only")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.modes, args.compiled)
        return
    models = args.models or (SMALL if args.quick else SMALL + MEDIUM)
    configs = args.configs or CONFIGS
    report = {}
    for model in models:
        steps = args.steps or (2 if args.quick else 5 if model in MEDIUM else 10)
        warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
        if args.compiled:
            # one process per mode: a second model instance in a process reuses the graphs compiled for the
            # first (Dynamo does not guard on module hooks), so ours would run in none's graph, unhooked
            report[model] = {c: run_compiled(model, c, steps, warmup, not args.no_predecessor) for c in configs}
            print_compiled(model, report[model])
            continue
        report[model] = summarise(model, run_interleaved(model, eager_modes(model), steps, warmup, compiled=False))
    report["load"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
