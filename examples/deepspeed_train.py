"""Train the tiny GPT under DeepSpeed with the monitor on: the one added line is `DeepSpeedMonitor`.

    OMP_NUM_THREADS=1 python -m examples.deepspeed_train            # spawns 2 CPU ranks (gloo)
    OMP_NUM_THREADS=1 python -m examples.deepspeed_train --ds-config configs/deepspeed/zero3_bf16.json
    OMP_NUM_THREADS=1 python -m examples.deepspeed_train --engine-monitor \
        --ds-config configs/deepspeed/zero1_bf16_tensorboard.json   # also into DeepSpeed's TensorBoard
    # one process per rank from a launcher (RANK/WORLD_SIZE/MASTER_* set by it):
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m examples.deepspeed_train
    deepspeed --num_gpus 2 --module examples.deepspeed_train          # on GPUs

On a CPU-only machine DeepSpeed runs with DS_ACCELERATOR=cpu and gloo; its
shared-memory communication op is skipped (it would be JIT-compiled first).
Then: `tensorboard --logdir <output-dir>`.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
from pathlib import Path

import torch

from examples.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DS_CONFIG = ROOT / "configs" / "deepspeed" / "zero2.json"
DEFAULT_MONITOR_CONFIG = ROOT / "configs" / "deepspeed" / "monitor.yaml"


def init_distributed() -> None:
    """Join DeepSpeed's process group (gloo when the accelerator is the CPU); once per process."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        # skip the JIT build of the shared-memory op (33-84 s); gloo does the communication
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())


def load_ds_config(path: str | Path, **overrides) -> dict:
    """A DeepSpeed config file with top-level keys replaced (e.g. gradient_accumulation_steps)."""
    return {**json.loads(Path(path).read_text(encoding="utf-8")), **overrides}


def train(args: argparse.Namespace) -> None:
    """One rank's training loop: DeepSpeed's usual loop plus the monitor line."""
    import deepspeed

    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model_cfg = GPTConfig(dim=64, layers=2, seq=32, batch=4)
    model = TinyGPT(model_cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=load_ds_config(
        args.ds_config, train_micro_batch_size_per_gpu=model_cfg.batch))
    monitor = DeepSpeedMonitor(engine, config={**_monitor_config(args.config), "output_dir": args.output_dir},
                               engine_monitor=args.engine_monitor)
    micro_steps = args.steps * engine.gradient_accumulation_steps()
    for tokens, targets in synthetic_batches(model_cfg, micro_steps, seed=1 + rank):
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
    monitor.close()
    if rank == 0 and monitor.history:
        last = monitor.history[-1]
        print(f"{world} ranks, ZeRO-{engine.zero_optimization_stage()}, {args.steps} steps; step {last.step}: "
              f"loss {last.metrics.get('train/loss', float('nan')):.4f}, "
              f"gradient norm {last.metrics.get('grad/global/norm', float('nan')):.4f}")
        print(f"tensorboard --logdir {args.output_dir}")


def _monitor_config(path: str) -> dict:
    from msprobe_engine.config.loader import read_file
    return read_file(Path(path))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ds-config", default=str(DEFAULT_DS_CONFIG), help="DeepSpeed config (JSON)")
    parser.add_argument("--config", default=str(DEFAULT_MONITOR_CONFIG), help="monitor config")
    parser.add_argument("--output-dir", default="./deepspeed_output")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn when not started by a launcher")
    parser.add_argument("--engine-monitor", action="store_true",
                        help="also write the metrics through DeepSpeed's own monitor (when its config enables one)")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" in os.environ:  # started by torchrun or the deepspeed launcher
        train(args)
        return 0
    with socket.socket() as sock:  # a free port for the spawned ranks to meet on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(args.world, port, args), nprocs=args.world)
    return 0


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train(args)


if __name__ == "__main__":
    sys.exit(main())
