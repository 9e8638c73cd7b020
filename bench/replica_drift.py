"""Cost of the replica-drift check (`replica_drift` rule) under DDP on 2 CPU ranks (gloo).

    OMP_NUM_THREADS=1 python bench/replica_drift.py [--layers 4] [--dim 64] [--steps 20]

Each rank trains the tiny GPT under DistributedDataParallel with no tool and times its
steps; then, in the same processes, times the check alone (hash every parameter bucket on
the device, all-gather the 8-byte hashes, compare): its cost relative to one training step,
and to a step when it runs every 100 steps (its default interval). Figures are medians in
milliseconds on rank 0; the last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from examples.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches  # noqa: E402

EVERY = 100


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel

    from msprobe_integrations.torch import TorchMonitor

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = GPTConfig(dim=args.dim, layers=args.layers, seq=32, batch=4)
    model = DistributedDataParallel(TinyGPT(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_s = []
    for tokens, targets in synthetic_batches(cfg, args.steps, seed=1 + rank):
        start = time.perf_counter()
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        step_s.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as tmp:
        monitor = TorchMonitor(model, optimizer, config={
            "output_dir": tmp, "sinks": [], "incidents": {"enabled": False},
            "watch": {"module_outputs": False, "param_grads": False},
            "alerts": [{"rule": "replica_drift", "every": EVERY, "bucket_numel": args.bucket_numel}]})
        check = monitor.replica_check
        check_s = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            check.check()
            check_s.append(time.perf_counter() - start)
        monitor.close()
    if rank == 0:
        step, cost = statistics.median(step_s), statistics.median(check_s)
        numel = sum(p.numel() for p in model.parameters())
        Path(out).write_text(json.dumps({
            "ranks": world, "params": numel, "buckets": len(check.buckets), "bytes_gathered_per_rank": 8 * len(check.buckets),
            "step_ms": round(step * 1e3, 3), "check_ms": round(cost * 1e3, 3),
            "check_over_step": round(cost / step, 4), f"overhead_every_{EVERY}": round(cost / step / EVERY, 5)}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-numel", type=int, default=1 << 16, help="elements per hashed bucket")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        torch.multiprocessing.spawn(_rank, args=(2, port, args, out.name), nprocs=2)
        print(Path(out.name).read_text())


if __name__ == "__main__":
    main()
