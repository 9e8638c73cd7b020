"""The debugger tasks on two gloo ranks (DDP): per-rank files, collectives never rerun."""
from __future__ import annotations

import csv

import pytest

from multiproc import run_ranks
from msprobe_engine.dump import load_dump

pytestmark = pytest.mark.slow  # spawns two processes


def _rank_main(rank: int, world: int, root: str) -> list[str]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from msprobe_engine.dump import PrecisionDebugger

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        x = torch.randn(3, 4) + rank
        probe = PrecisionDebugger({"task": "grad_probe", "dump_path": f"{root}/grad", "strict": True,
                                   "grad_probe": {"grad_level": "L1"}})
        probe.monitor(model)
        model(x).sum().backward()
        opt.step()
        probe.close()
        with PrecisionDebugger({"task": "overflow_check", "dump_path": f"{root}/overflow", "strict": True}) as d:
            with d.step_scope(model):
                (torch.sqrt(x - 10.0 * rank) if rank else torch.sqrt(x.abs())).sum()  # nan on rank 1 only
        with PrecisionDebugger({"task": "free_benchmark", "dump_path": f"{root}/fuzz", "strict": True,
                                "free_benchmark": {"pert_mode": "add_noise"}}) as d:
            with d.step_scope(model):
                y = torch.relu(x)
                dist.all_reduce(y)  # a collective: never run twice
        return [str(y.sum().item())]
    finally:
        dist.destroy_process_group()


def test_two_ranks(tmp_path):
    sums = run_ranks(_rank_main, 2, str(tmp_path), timeout=180)
    assert sums[0] == sums[1]  # the all_reduce ran once on each rank, in step
    rows = []
    for rank in (0, 1):
        with open(tmp_path / "grad" / f"rank{rank}" / "grad_summary_0.csv", newline="") as f:
            rows.append(list(csv.reader(f)))
    assert rows[0] == rows[1] and len(rows[0]) == 5  # DDP averaged the gradients: the same on both ranks
    assert (tmp_path / "grad" / "rank1" / "step0" / "module.0.weight.npy").is_file()
    assert sorted(load_dump(tmp_path / "overflow")) == [(0, 1)]
    assert list(load_dump(tmp_path / "overflow")[(0, 1)].data) == ["Torch.sqrt.0.forward"]
