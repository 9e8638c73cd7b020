"""Cost of the model-health signals (`watch.health`) on a transformers GPT-2 (eager attention, and SDPA).

    OMP_NUM_THREADS=1 python bench/model_health.py [--layers 4] [--dim 128] [--seq 64] [--rounds 5] [--steps 4]
        [--only off,collectives] [--collective-calls 2000]

One monitor per configuration (health off; each signal alone; all on), each with its own copy
of the model, timed in interleaved rounds (every round runs `steps` steps of each
configuration in turn), so load changes hit them alike. Prints the median step time of each
and its ratio to "off" (to "off_sdpa" for the SDPA model, whose entropy is sampled from q/k);
the last line is one JSON object. `--collective-calls N` also times N all-reduces of one float
on a one-rank gloo group with the collectives' wrapper listening and without it (its cost per
call; the step's rows are what the "collectives" configuration costs).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from msprobe_engine import Monitor  # noqa: E402

#: name -> (watch.health, the model's attention implementation)
CONFIGS = {"off": ({}, "eager"), "attention_entropy": ({"attention_entropy": True}, "eager"),
           "off_sdpa": ({}, "sdpa"), "attention_entropy_sdpa": ({"attention_entropy": True}, "sdpa"),
           "stable_rank_every_1": ({"stable_rank_every": 1}, "eager"), "mg_direction": ({"mg_direction": True}, "eager"),
           "micro_batch_grads": ({"micro_batch_grads": True}, "eager"),
           "collectives": ({"collectives": True}, "eager"),
           "all": ({"attention_entropy": True, "stable_rank_every": 1, "mg_direction": True, "micro_batch_grads": True},
                   "eager")}


def _model(args: argparse.Namespace, attention: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.dim, n_head=4, vocab_size=512,
                                      n_positions=args.seq, attn_implementation=attention))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--only", default="", help="comma-separated configurations (default: all; off/off_sdpa kept)")
    p.add_argument("--collective-calls", type=int, default=0)
    args = p.parse_args()
    wanted = set(args.only.split(",")) | {"off", "off_sdpa"} if args.only else set(CONFIGS)
    torch.set_num_threads(1)
    out = tempfile.mkdtemp()
    runs = {}
    for name, (health, attention) in CONFIGS.items():
        if name not in wanted or (name == "off_sdpa" and not any(n.endswith("sdpa") for n in wanted - {"off_sdpa"})):
            continue
        model = _model(args, attention)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mon = Monitor({"output_dir": out, "run_name": name, "sinks": [], "watch": {"health": health}}).attach(model, opt)
        runs[name] = (model, opt, mon, [])
    ids = torch.randint(0, 512, (4, args.seq), generator=torch.Generator().manual_seed(1))
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, (model, opt, mon, times) in runs.items():
            for _ in range(args.steps):
                start = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                mon.step_end()
                if round_:
                    times.append(time.perf_counter() - start)
    result = {}
    for name, (_, _, mon, times) in runs.items():
        mon.close()
        base = statistics.median(runs["off_sdpa" if name.endswith("sdpa") else "off"][3])
        median = statistics.median(times)
        result[name] = {"median_ms": round(median * 1e3, 2), "ratio_to_off": round(median / base, 3)}
        print(f"{name:22s} {median * 1e3:8.2f} ms  x{median / base:.3f}")
    if args.collective_calls:
        result["collective_call_us"] = _collective_call_cost(args.collective_calls)
        print(f"all_reduce per call: {result['collective_call_us']}")
    print(json.dumps({"args": vars(args), "steps": result}))


def _collective_call_cost(calls: int) -> dict:
    """Microseconds per all-reduce of one float on a one-rank gloo group, without and with the
    collectives' wrapper listening (medians of 5 interleaved batches of `calls` // 10 each)."""
    import os

    import torch.distributed as dist

    from msprobe_engine.frameworks.torch import collective_calls

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(1)

    def batch() -> float:
        start = time.perf_counter()
        for _ in range(calls // 10):
            dist.all_reduce(t)
        return (time.perf_counter() - start) / (calls // 10) * 1e6

    plain, listened = [], []
    for _ in range(5):  # interleaved, so load changes hit both alike
        plain.append(batch())
        listening = collective_calls.listen(lambda kind, size: None)
        listened.append(batch())
        listening.remove()
    dist.destroy_process_group()
    return {"plain": round(statistics.median(plain), 2), "listened": round(statistics.median(listened), 2)}


if __name__ == "__main__":
    main()
