"""`watch.health.collectives`: the training's own torch.distributed collectives per monitored step
(calls and bytes per op kind), on 2 gloo ranks, against the collectives the test itself
issues, rows merged as under DDP; the monitor's own (its statistics merge, `agree_flags`) are not counted, and with the
signal off (or the monitor closed) torch.distributed holds its own functions."""
from __future__ import annotations

from tests.multiproc import run_ranks

STEPS = 3


def _issue(rank: int, step: int) -> list[tuple[str, int]]:
    """The test's own collectives of one step (more of them each step); (kind, bytes) of each."""
    import torch
    import torch.distributed as dist

    issued = []
    for i in range(step + 1):
        t = torch.ones(10 + i)
        dist.all_reduce(t)
        issued.append(("all_reduce", t.numel() * t.element_size()))
    piece = torch.full((3,), float(rank), dtype=torch.float64)
    dist.all_gather_into_tensor(torch.empty(6, dtype=torch.float64), piece)
    issued.append(("all_gather", piece.numel() * piece.element_size()))
    b = torch.arange(4)
    dist.broadcast(b, src=0)
    issued.append(("broadcast", b.numel() * b.element_size()))
    p2p = torch.zeros(5)
    op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, p2p, 1 - rank)
    for work in dist.batch_isend_irecv([op]):
        work.wait()
    issued.append(("send" if rank == 0 else "recv", p2p.numel() * p2p.element_size()))
    dist.barrier()
    issued.append(("barrier", 0))
    return issued


def _rank(rank: int, world: int, out: str) -> dict:
    import torch
    import torch.distributed as dist

    from msprobe_engine import Monitor
    from msprobe_engine.frameworks.torch.data_parallel import DataParallelMerge, Wrapping
    from msprobe_engine.frameworks.torch.distributed import agree_flags

    dist.init_process_group("gloo")
    originals = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "batch_isend_irecv")}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config = {"output_dir": out, "sinks": [], "strict": True, "stats": ["mean", "max", "min"]}
    Monitor({**config, "run_name": "off"}).attach(model).close()
    unpatched_when_off = all(getattr(dist, n) is f for n, f in originals.items())
    # the statistics merge DDP gets (two all-reduces a step); DDP and an optimizer are left out: the
    # first DDP construction and the first optimizer step import torch._dynamo, 6-15 s a rank here
    merge = DataParallelMerge(Wrapping("ddp", model), list(model.named_parameters()), per_rank=False)
    monitor = Monitor({**config, "run_name": "on", "watch": {"health": {"collectives": True}}},
                      reducer=merge).attach(model)
    issued = []
    for step in range(STEPS):
        model(torch.randn(8, 4)).sum().backward()
        issued.append(_issue(rank, step))
        agree_flags(False, False)  # the monitor's own collective: not counted
        model.zero_grad()
        monitor.step_end()
    monitor.close()
    restored = all(getattr(dist, n) is f for n, f in originals.items())
    dist.destroy_process_group()
    return {"metrics": [r.metrics for r in monitor.history], "issued": issued,
            "unpatched_when_off": unpatched_when_off, "restored": restored}


def test_collectives_per_step_are_the_trainings_own(tmp_path):
    from msprobe_engine.frameworks.torch.collective_calls import KINDS

    results = run_ranks(_rank, 2, str(tmp_path), timeout=180)
    assert all(r["unpatched_when_off"] and r["restored"] for r in results)
    metrics = results[0]["metrics"]
    assert len(metrics) == STEPS
    for step in range(STEPS):
        per_rank = [{kind: [0, 0] for kind in KINDS} for _ in results]
        for counts, r in zip(per_rank, results):
            for kind, size in r["issued"][step]:
                counts[kind][0] += 1
                counts[kind][1] += size
        for kind in KINDS:  # merged over the 2 ranks: mean, busiest and idlest rank
            for role, at in (("calls", 0), ("bytes", 1)):
                values = [counts[kind][at] for counts in per_rank]
                row = f"comm/{kind}/{role}"
                assert metrics[step][f"{row}/mean"] == sum(values) / 2, (step, row)
                assert (metrics[step][f"{row}/max"], metrics[step][f"{row}/min"]) == (max(values), min(values))
    assert metrics[2]["comm/all_reduce/calls/mean"] == 3  # the merge's and agree_flags' all-reduces left out
    assert metrics[0]["comm/send/calls/max"] == 1 and metrics[0]["comm/send/calls/min"] == 0
