"""Bytes and time of the statistics merge (`frameworks.torch.distributed.GroupMerge`) per monitored step.

    OMP_NUM_THREADS=1 python bench/collectives.py [--worlds 2,4,8] [--fake-worlds 1024,16384] [--rows 1550]

Part 1, gloo (one process per rank on this host): the tiny GPT under DDP with configs/full.yaml's
`watch` (sinks and incidents off), a few monitored steps. Every call of the merge's collective
(`distributed._all_reduce`) is wrapped to count its buffer's bytes, and the merge is timed: per rank
and monitored step, the collectives, the bytes in their buffers (what a rank sends and receives
in an all-reduce; a ring moves at most 2x that on the wire) then, in the same processes, the median time of one merge of as many random rows
(`merge_ms`: both all-reduces and the host work) and of one all-gather of them (`gather_ms`: the
collective the merge replaced, alone), interleaved. `gather_bytes` is what that all-gather
received: world x (k + 1) x 64 B.

Part 2, one process with torch's fake process group (collectives do nothing, buffers are real):
the code path for `--rows` rows (a 7B model: ~1,550) at each of `--fake-worlds`: the buffers'
bytes (the merge's only extra memory besides the merged rows) and the host time of one merge
(median of 20), and the collectives and bytes of one merge over tensor parallel 8 x data
parallel (`NestedMerge`: one pair over the world). The last line printed is one JSON object.
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

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


class Counted:
    """Wraps the merge's collective and `GroupMerge.__call__`: bytes, calls and time per merge."""

    def __init__(self) -> None:
        from msprobe_engine.frameworks.torch import distributed as torch_distributed

        self.module = torch_distributed
        self.sizes: list[int] = []
        self.merge_s: list[float] = []
        self.rows: list[int] = []
        self._reduce, self._call = torch_distributed._all_reduce, torch_distributed.GroupMerge.__call__

    def __enter__(self) -> "Counted":
        counted = self

        def reduce(tensor, *args, **kwargs):
            counted.sizes.append(tensor.numel() * tensor.element_size())
            return counted._reduce(tensor, *args, **kwargs)

        def call(merge, keys, rows, *args, **kwargs):
            start = time.perf_counter()
            out = counted._call(merge, keys, rows, *args, **kwargs)
            counted.merge_s.append(time.perf_counter() - start)
            counted.rows.append(len(keys))
            counted.keys, counted.policy = list(keys), args[0]
            return out

        self.module._all_reduce, self.module.GroupMerge.__call__ = reduce, call
        return self

    def __exit__(self, *exc) -> None:
        self.module._all_reduce, self.module.GroupMerge.__call__ = self._reduce, self._call


def _interleaved(keys, policy, rounds: int = 15) -> tuple[float, float]:
    """Median ms of one merge of random rows under the run's last layout and policy, and of one
    all-gather of as many rows plus a marker (the collective the merge replaced), interleaved."""
    from msprobe_engine.frameworks.torch.distributed import GroupMerge, gather_rows

    rows = torch.randn(len(keys), 8, dtype=torch.float64)
    merge, merge_s, gather_s = GroupMerge(None), [], []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        merge(keys, rows, policy)
        merge_s.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        gather_rows(torch.cat([rows, rows[:1]]))
        gather_s.append(time.perf_counter() - start)
    return (round(statistics.median(merge_s[1:]) * 1e3, 3), round(statistics.median(gather_s[1:]) * 1e3, 3))


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import yaml

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel

    from examples.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
    from msprobe_integrations.torch import TorchMonitor

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = GPTConfig(dim=32, layers=2, seq=16, batch=2)
    model = DistributedDataParallel(TinyGPT(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    full = yaml.safe_load((ROOT / "configs" / "full.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp, Counted() as counted:
        monitor = TorchMonitor(model, optimizer, config={"output_dir": tmp, "sinks": [], "watch": full["watch"],
                                                         "incidents": {"enabled": False}})
        for tokens, targets in synthetic_batches(cfg, STEPS, seed=1 + rank):
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step_end(loss.detach())
        monitor.close()
    merge_ms, gather_ms = _interleaved(counted.keys, counted.policy)
    if rank == 0:
        k = counted.rows[-1]
        Path(out).write_text(json.dumps({
            "world": world, "rows": k, "merges": len(counted.merge_s), "monitored_steps": STEPS,
            "collectives_per_step": len(counted.sizes) / STEPS,
            "bytes_per_step": sum(counted.sizes) / STEPS, "buffers": counted.sizes[:2],
            "gather_bytes": world * (k + 1) * 64,
            "merge_ms": merge_ms, "gather_ms": gather_ms}))
    dist.destroy_process_group()


def gloo(world: int) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        torch.multiprocessing.spawn(_rank, args=(world, port, out.name), nprocs=world)
        return json.loads(Path(out.name).read_text())


def fake(world: int, rows: int) -> dict:
    """The merge's code path at `world` ranks in this process (a fake process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from msprobe_engine.frameworks.torch.distributed import MERGE, ONCE, GroupMerge
    from msprobe_engine.stats.table import MetricKey

    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    try:
        # a 7B model's mix: ~3/4 model-state rows (taken once under DDP), the rest merged
        keys = [MetricKey("grad" if i % 4 else "actv", f"m{i}") for i in range(rows)]
        policy = {key: ONCE if key.kind == "grad" else MERGE for key in keys}.get
        values = torch.randn(rows, 8, dtype=torch.float64)
        with Counted() as counted:
            merge = GroupMerge(None)
            for _ in range(21):
                merge(keys, values, policy)
        one = {"world": world, "rows": rows, "buffers": counted.sizes[:2], "bytes": sum(counted.sizes[:2]),
               "gather_bytes": world * (rows + 1) * 64,
               "host_ms": round(statistics.median(counted.merge_s[1:]) * 1e3, 3)}
        return {**one, "tp8_x_dp": _stage(world, keys, values)}
    finally:
        dist.destroy_process_group()


def _stage(world: int, keys: list, values: torch.Tensor) -> dict:
    """Tensor parallel 8 x data parallel world/8 (`NestedMerge` over the world): the collectives
    and bytes of one merge (activations `auto` over TP, model state once over both)."""
    from msprobe_engine.frameworks.torch import distributed as torch_distributed
    from msprobe_engine.frameworks.torch.distributed import AUTO, MERGE, ONCE, NestedMerge

    rank, tp = world - 1, 8
    tp_group = dist.new_group(list(range(rank - rank % tp, rank - rank % tp + tp)))
    dp_group = dist.new_group(list(range(rank % tp, world, tp)))
    parts = [(tp_group, "tensor", lambda key: ONCE if key.kind == "grad" else AUTO),
             (dp_group, "data", lambda key: ONCE if key.kind == "grad" else MERGE)]
    sizes, original = [], torch_distributed._all_reduce

    def counting(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    torch_distributed._all_reduce = counting
    try:
        NestedMerge(parts, stage=dist.group.WORLD)(keys, values)
    finally:
        torch_distributed._all_reduce = original
    return {"calls": len(sizes), "bytes": sum(sizes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--fake-worlds", default="1024,16384")
    parser.add_argument("--rows", type=int, default=1550)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    real = [gloo(int(w)) for w in args.worlds.split(",") if w]
    simulated = [fake(int(w), args.rows) for w in args.fake_worlds.split(",") if w]
    print(f"{'backend':8} {'world':>6} {'rows':>6} {'calls/step':>10} {'bytes/rank/step':>16} "
          f"{'all-gather bytes':>17} {'merge ms':>9} {'gather ms':>9}")
    for r in real:
        print(f"{'gloo':8} {r['world']:>6} {r['rows']:>6} {r['collectives_per_step']:>10.1f} "
              f"{r['bytes_per_step']:>16,.0f} {r['gather_bytes']:>17,} {r['merge_ms']:>9} {r['gather_ms']:>9}")
    for r in simulated:
        print(f"{'fake':8} {r['world']:>6} {r['rows']:>6} {2:>10} {r['bytes']:>16,} {r['gather_bytes']:>17,} "
              f"{r['host_ms']:>9} {'-':>9}")
        stage = r["tp8_x_dp"]
        print(f"{'fake':8} {r['world']:>6} {r['rows']:>6} {stage['calls']:>10} {stage['bytes']:>16,} "
              f"{'(TP 8 x DP)':>17} {'-':>9} {'-':>9}")
    print(json.dumps({"gloo": real, "fake": simulated}))


if __name__ == "__main__":
    main()
