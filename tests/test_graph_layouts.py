"""`graph` across parallel layouts: a model split column-wise over two gloo ranks (tensor
parallel by hand) against the same model on one process. Names match; sharded tensors differ
in shape and are reported as such (not merged); layers that are not sharded compare clean."""
from __future__ import annotations

import pytest

from multiproc import run_ranks
from msprobe_engine.analysis.graph import build_graphs
from msprobe_engine.analysis.graph.model import ERROR, PASS

pytestmark = pytest.mark.slow
SHARD = "Module.col.part.Linear.forward.0"
GATHERED = "Module.col.Column.forward.0"
HEAD = "Module.head.Linear.forward.0"


def _dump(rank: int, world: int, root: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from msprobe_engine.dump import PrecisionDebugger

    class Column(nn.Module):
        """A Linear(8, 8) whose output features are split over the ranks and gathered back."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            full = nn.Linear(8, 8)
            rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
            self.part = nn.Linear(8, 8 // world)
            with torch.no_grad():
                self.part.weight.copy_(full.weight[rows])
                self.part.bias.copy_(full.bias[rows])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.part(x)
            if world == 1:
                return y
            parts = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(parts, y)
            return torch.cat(parts, dim=-1)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.col = Column()
            torch.manual_seed(1)
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.col(x))

    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = Net()
        with PrecisionDebugger({"dump_path": root, "level": "L0", "strict": True}) as debugger:
            debugger.start(model)
            with torch.no_grad():
                model(torch.linspace(-1, 1, 32).reshape(4, 8))
            debugger.stop()
            debugger.step()
    finally:
        if world > 1:
            dist.destroy_process_group()


def test_two_tensor_parallel_ranks_against_one_process(tmp_path):
    _dump(0, 1, str(tmp_path / "tp1"))
    run_ranks(_dump, 2, str(tmp_path / "tp2"), timeout=180)
    result = build_graphs(tmp_path / "tp2", tmp_path / "tp1")
    assert [(g.step, g.rank) for g in result.targets] == [(0, 0), (0, 1)]
    assert all(r.source == result.references[0].source for r in result.references)  # the one rank, twice
    for graph, structure in zip(result.targets, result.structures):
        assert structure.same  # the same module names on every layout
        shard = graph.nodes[SHARD]
        assert shard.precision == ERROR  # reference (one process) vs target (a shard):
        assert shard.outputs[f"{SHARD}.output.0"]["Err_message"].startswith("shape [4, 8] vs [4, 4]")
        assert shard.inputs[f"{SHARD}.parameters.weight"]["Err_message"].startswith("shape [8, 8] vs [4, 8]")
        assert graph.nodes[GATHERED].outputs[f"{GATHERED}.output.0"]["Result"] == "pass"  # gathered back: equal
        assert graph.nodes[HEAD].precision == PASS  # not sharded
        assert graph.first_divergence == SHARD
