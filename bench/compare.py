"""Benchmark `compare` on a generated tensor dump: time and peak memory against one plain read.

    OMP_NUM_THREADS=1 python bench/compare.py [--entries 500] [--size-mb 1024] [--dir DIR]

Writes two dumps (A, and B = A with a small relative perturbation) of ``--entries`` float32
tensors, ``--size-mb`` in all (every 50th tensor 8x larger than the rest), then runs, each in a
fresh process: a plain read of every tensor file's bytes, a torch.load of every file, the
comparison (CSV written), and the plain read again (the faster read is the reference; the page
cache is warm for all of them, so the plain read runs at memory speed).
The last line printed is one JSON object with the figures.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _sizes(entries: int, total_bytes: int) -> list[int]:
    weights = [8 if i % 50 == 0 else 1 for i in range(entries)]
    unit = total_bytes / 2 / 4 / sum(weights)  # two dumps, float32
    return [max(1, int(w * unit)) for w in weights]


def generate(root: Path, entries: int, size_mb: float) -> int:
    """Write dumps A and B under ``root``; returns the largest pair's size in bytes."""
    import torch

    torch.manual_seed(0)
    sizes = _sizes(entries, int(size_mb * 2**20))
    docs = {}
    for side in "ab":
        (root / side / "step0" / "rank0" / "dump_tensor_data").mkdir(parents=True)
        docs[side] = {"task": "tensor", "level": "L1", "framework": "pytorch", "dump_data_dir": None, "data": {}}
    for i, n in enumerate(sizes):
        a = torch.randn(n)
        b = a * (1 + 1e-4 * torch.randn(n))
        for side, t in (("a", a), ("b", b)):
            name = f"Functional.linear.{i}.forward"
            rec = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [n], "Max": t.max().item(),
                   "Min": t.min().item(), "Mean": t.mean().item(), "Norm": t.norm().item(),
                   "requires_grad": False, "data_name": f"{name}.output.0.pt"}
            torch.save(t, root / side / "step0" / "rank0" / "dump_tensor_data" / rec["data_name"])
            docs[side]["data"][name] = {"input_args": [], "input_kwargs": {}, "output": [rec]}
    for side, doc in docs.items():
        (root / side / "step0" / "rank0" / "dump.json").write_text(json.dumps(doc))
    return 2 * 4 * max(sizes)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def phase_read(root: Path) -> dict:
    """Read every tensor file once, in 16 MiB blocks."""
    start = time.perf_counter()
    total = 0
    for file in sorted(root.glob("*/step0/rank0/dump_tensor_data/*.pt")):
        with open(file, "rb", buffering=0) as f:
            while block := f.read(16 << 20):
                total += len(block)
    return {"seconds": time.perf_counter() - start, "bytes": total, "peak_rss_mb": _peak_rss_mb()}


def phase_load(root: Path) -> dict:
    """Load every tensor file once with torch.load (torch imported before the clock starts)."""
    import torch

    start = time.perf_counter()
    for file in sorted(root.glob("*/step0/rank0/dump_tensor_data/*.pt")):
        torch.load(file, map_location="cpu", weights_only=True)
    return {"seconds": time.perf_counter() - start, "peak_rss_mb": _peak_rss_mb()}


def phase_compare(root: Path) -> dict:
    """Run compare_dumps A vs B with the CSV written, as the CLI does."""
    import torch  # noqa: F401  (imported before the baseline so that it does not count as compare memory)

    from msprobe_engine.analysis.compare import compare_dumps
    from msprobe_engine.analysis.report import RowWriter

    baseline = _rss_mb()
    start = time.perf_counter()
    with RowWriter(root / "compare.csv") as writer:
        comp = compare_dumps(root / "a", root / "b", on_row=writer.write, keep_rows=False, progress=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "baseline_rss_mb": baseline, "peak_rss_mb": _peak_rss_mb(),
            "counts": comp.ranks[0].counts}


PHASES = {"read": phase_read, "load": phase_load, "compare": phase_compare}


def _run_phase(phase: str, root: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", phase, "--dir", str(root)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=500)
    parser.add_argument("--size-mb", type=float, default=1024, help="total size of both dumps")
    parser.add_argument("--dir", type=Path, help="work directory (default: a temporary one, removed after)")
    parser.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(PHASES[args.phase](args.dir)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        largest_pair = generate(root, args.entries, args.size_mb)
        print(f"generated {args.entries} entries x 2 dumps, {args.size_mb:g} MB, in {time.perf_counter() - start:.1f} s")
        reads = [_run_phase("read", root)]
        load = _run_phase("load", root)
        compare = _run_phase("compare", root)
        reads.append(_run_phase("read", root))
        read = min(reads, key=lambda r: r["seconds"])
    ratio = compare["seconds"] / read["seconds"]
    print(f"plain read: {read['seconds']:.2f} s for {read['bytes'] / 2**20:.0f} MiB (page cache warm)")
    print(f"torch.load: {load['seconds']:.2f} s for the same files")
    print(f"compare:    {compare['seconds']:.2f} s ({ratio:.2f}x the read, {compare['seconds'] / load['seconds']:.2f}x "
          f"the torch.load pass), statuses {compare['counts']}")
    print(f"peak RSS:   {compare['peak_rss_mb']:.0f} MiB, {compare['peak_rss_mb'] - compare['baseline_rss_mb']:.0f} MiB "
          f"above the process after imports; largest tensor pair {largest_pair / 2**20:.0f} MiB")
    print(json.dumps({"compare_over_read": round(ratio, 3), "compare_s": round(compare["seconds"], 3),
                      "read_s": round(read["seconds"], 3), "load_s": round(load["seconds"], 3),
                      "compare_over_load": round(compare["seconds"] / load["seconds"], 3), "dump_mb": round(read["bytes"] / 2**20, 1),
                      "peak_rss_mb": round(compare["peak_rss_mb"], 1),
                      "rss_over_baseline_mb": round(compare["peak_rss_mb"] - compare["baseline_rss_mb"], 1),
                      "largest_pair_mb": round(largest_pair / 2**20, 1)}))


if __name__ == "__main__":
    main()
