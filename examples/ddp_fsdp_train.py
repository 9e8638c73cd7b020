"""Train the tiny GPT data-parallel with PyTorch's own wrappers, the monitor on.

    OMP_NUM_THREADS=1 python -m examples.ddp_fsdp_train                   # DDP, spawns 2 CPU ranks (gloo)
    OMP_NUM_THREADS=1 python -m examples.ddp_fsdp_train --wrap fsdp2      # fully_shard per block
    OMP_NUM_THREADS=1 python -m examples.ddp_fsdp_train --wrap hsdp --world 4   # 2x2 mesh
    OMP_NUM_THREADS=1 python -m examples.ddp_fsdp_train --wrap fsdp2 --local-norm   # the classic bug
    # one process per rank from a launcher (RANK/WORLD_SIZE/MASTER_* set by it):
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m examples.ddp_fsdp_train --wrap fsdp2

The loop reports `clip_grad_norm_`'s return with `monitor.report_grad_norm`; with
`--local-norm` it reports the norm of this rank's shards instead, and the
`misreported_grad_norm` rule raises an alert. Every 2 steps the `replica_drift` rule
compares the replicas' parameters (DDP, HSDP). Then: `tensorboard --logdir <output-dir>`.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from examples.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

MAX_NORM = 1.0


def wrap(model: TinyGPT, how: str, world: int) -> torch.nn.Module:
    """`model` under DDP, FSDP2 (one `fully_shard` per block and the root) or HSDP (2-D mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if how == "ddp":
        return DistributedDataParallel(model)
    if how == "hsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def local_shard_norm(model: torch.nn.Module) -> torch.Tensor:
    """The norm of this rank's gradient shards only: what a loop gets wrong under FSDP."""
    from msprobe_engine.frameworks.torch.fsdp import local_tensor
    return torch.linalg.vector_norm(torch.stack([local_tensor(p.grad).norm() for p in model.parameters()
                                                 if p.grad is not None]))


def train(args: argparse.Namespace) -> None:
    from msprobe_integrations.torch import TorchMonitor

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(dim=32, layers=2, seq=16, batch=4)
    model = wrap(TinyGPT(cfg), args.wrap, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = TorchMonitor(model, optimizer, config={
        "output_dir": args.output_dir, "watch": {"params": True, "optimizer_state": ["exp_avg", "exp_avg_sq"]},
        "alerts": [{"rule": "non_finite"}, {"rule": "misreported_grad_norm"},
                   *([{"rule": "replica_drift", "every": 2}] if args.wrap != "fsdp2" else [])]})
    for tokens, targets in synthetic_batches(cfg, args.steps, seed=1 + rank):
        loss = model(tokens, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        monitor.report_grad_norm(local_shard_norm(model) if args.local_norm else norm, max_norm=MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        monitor.step_end(loss.detach())
    monitor.close()
    if rank == 0 and monitor.history:
        last = monitor.history[-1].metrics
        print(f"{args.wrap} on {world} ranks, {args.steps} steps: loss {last['train/loss']:.4f}, merged gradient "
              f"norm {last['grad/global/norm']:.4f}, reported {last['train/reported_grad_norm']:.4f}; "
              f"alerts: {sorted({e.rule for e in monitor.alert_log}) or 'none'}")
        print(f"tensorboard --logdir {args.output_dir}")
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wrap", choices=("ddp", "fsdp2", "hsdp"), default="ddp")
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn when not started by a launcher")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--local-norm", action="store_true", help="report the local shards' norm (a bug)")
    parser.add_argument("--output-dir", default="./ddp_fsdp_output")
    args = parser.parse_args(argv)
    if args.wrap == "hsdp" and args.world % 2:
        parser.error("--wrap hsdp needs an even --world (a (world/2) x 2 mesh)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "RANK" in os.environ:  # started by torchrun
        train(args)
        return 0
    # no launcher: torch's own elastic agent starts the ranks here (what torchrun would do)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    ranks = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.world, run_id="ddp_fsdp_train",
                         rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2)
    elastic_launch(ranks, train)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
