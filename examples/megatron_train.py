"""Train a tiny Megatron-core GPT with the monitor on: the two added lines are marked `# msprobe`.

    OMP_NUM_THREADS=1 python -m examples.megatron_train                 # TP=2 on 2 spawned CPU ranks
    OMP_NUM_THREADS=1 python -m examples.megatron_train --tp 1 --pp 2   # pipeline parallel
    OMP_NUM_THREADS=1 python -m examples.megatron_train --tp 1 --dp 2 --distributed-optimizer
    OMP_NUM_THREADS=1 python -m examples.megatron_train --inject-step 4 --check-nan
    OMP_NUM_THREADS=1 python -m examples.megatron_train --inject-step 4 --check-nan --rerun-mode validate_results
    # one process per rank from a launcher (RANK/WORLD_SIZE/MASTER_* set by it):
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m examples.megatron_train --tp 2

The loop has the shape of Megatron-LM's `train()`: model chunks wrapped in Megatron's
DistributedDataParallel, a Megatron optimizer, `train_step` (forward/backward over the
micro-batches, `finalize_model_grads`, `optimizer.step()`). On a CPU-only machine it runs
with gloo and the test-only patches of tests/megatron_helpers.py; on GPUs use Megatron's
own `get_model`, `get_megatron_optimizer` and `get_forward_backward_func` instead.
`--inject-step N` puts a nan into layer 1's first MLP weight before step N: the monitor's
non_finite alert names that layer. With `--check-nan` Megatron's own loss check then raises
(`--rerun-mode disabled`) or re-runs the step and exits (`validate_results`), in both cases
after the monitor has written the step. Then: `tensorboard --logdir <output-dir>`.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "megatron" / "monitor.yaml"


def train(args: argparse.Namespace) -> None:
    """One rank's training loop: Megatron's usual loop plus the two monitor lines."""
    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import RerunMode

    from msprobe_engine.config.loader import read_file
    from msprobe_integrations.megatron import MegatronMonitor
    from tests import megatron_helpers as H

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(1)
    H.init_parallel(tp=args.tp, pp=args.pp, rerun_mode=RerunMode(args.rerun_mode))
    spec = H.TinySpec(layers=args.layers)
    model = [H.wrap_ddp(H.build_gpt(spec), distributed_optimizer=args.distributed_optimizer)]
    optimizer = H.build_optimizer(model)
    config = {**read_file(Path(args.config)), "output_dir": args.output_dir}
    monitor = MegatronMonitor(model, optimizer, config=config)  # msprobe
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    for iteration in range(args.steps):
        if iteration == args.inject_step:
            H.inject_nan(model[0], layer=1)
        batches = H.micro_batches(spec, args.micro_batches, seed=iteration * dp + dp_rank)
        loss, grad_norm, should_exit = H.train_step(model[0], optimizer, batches, check_nan=args.check_nan)
        monitor.step_end(loss)  # msprobe
        if should_exit:  # Megatron's re-run engine found the nan again: checkpoint and exit
            break
    monitor.close()
    last = monitor.history[-1].metrics if monitor.history else {}
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0 \
            and dp_rank == 0:
        print(f"TP={args.tp} PP={args.pp} DP={dp}, {iteration + 1} steps; last loss "
              f"{last.get('train/loss', float('nan')):.4f}, this stage's grad norm "
              f"{last.get('grad/global/norm', float('nan')):.4f} (Megatron's, all stages: "
              f"{'skipped' if grad_norm is None else f'{grad_norm:.4f}'})")
        print(f"tensorboard --logdir {args.output_dir}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (spawned ranks = tp*pp*dp)")
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--inject-step", type=int, default=-1, help="put a nan into layer 1 before this step")
    parser.add_argument("--check-nan", action="store_true", help="Megatron-LM's check_for_nan_in_loss_and_grad")
    parser.add_argument("--rerun-mode", choices=["disabled", "validate_results"], default="disabled",
                        help="Megatron's re-run engine (Megatron-LM's --rerun-mode)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="monitor config")
    parser.add_argument("--output-dir", default="./megatron_output")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))  # tests.megatron_helpers, in every rank
    if "RANK" in os.environ:  # started by torchrun
        train(args)
        return 0
    with socket.socket() as sock:  # a free port for the spawned ranks to meet on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    world = args.tp * args.pp * args.dp
    torch.multiprocessing.spawn(_spawned, args=(world, port, args), nprocs=world)
    return 0


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, str(ROOT))
    train(args)


if __name__ == "__main__":
    sys.exit(main())
