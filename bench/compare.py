"""Benchmark `compare` on a generated tensor dump: time and peak memory against one plain read.

    OMP_NUM_THREADS=1 python bench/compare.py [--entries 500] [--size-mb 1024] [--repeat 3] [--dir DIR]

Writes two dumps (A, and B = A with a small relative perturbation) of ``--entries`` float32
tensors, ``--size-mb`` in all (every 50th tensor 8x larger than the rest), then runs ``--repeat``
rounds of three phases, each phase in a fresh process (torch imported before the clock starts):

- read (the reference, "one plain read of the same files"): every tensor file of both dumps
  loaded into memory one after the other as a user would, ``torch.load(file, map_location="cpu",
  weights_only=True)``, which includes the deserialisation (zip directory, the weights-only
  unpickler) and the copy of the data into a new tensor;
- compare: ``compare_dumps`` of A and B with the CSV written, as the CLI does;
- raw read (an extra figure, not the reference): the bytes of every tensor file read in 16 MiB
  blocks, no deserialisation, i.e. the speed of the page cache.

The page cache is warm for all phases (the dumps were just written). Figures are medians over the
rounds; ``*_cpu_s`` is the CPU time (user + system) of the phase, less disturbed than wall time on
a busy machine. The last line printed is one JSON object with the figures.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
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


def _files(root: Path) -> list[Path]:
    return sorted(root.glob("*/step0/rank0/dump_tensor_data/*.pt"))


def phase_raw(root: Path) -> dict:
    """Read the bytes of every tensor file once, in 16 MiB blocks (no deserialisation)."""
    files = _files(root)
    start, cpu = time.perf_counter(), time.process_time()
    total = 0
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while block := f.read(16 << 20):
                total += len(block)
    return {"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "bytes": total,
            "peak_rss_mb": _peak_rss_mb()}


def phase_read(root: Path) -> dict:
    """The reference: load every tensor file into memory once, torch.load(weights_only=True)."""
    import torch

    files = _files(root)
    start, cpu = time.perf_counter(), time.process_time()
    for file in files:
        torch.load(file, map_location="cpu", weights_only=True)
    return {"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "peak_rss_mb": _peak_rss_mb()}


def phase_compare(root: Path) -> dict:
    """Run compare_dumps A vs B with the CSV written, as the CLI does."""
    import torch  # noqa: F401  (imported before the baseline so that it does not count as compare memory)

    from msprobe_engine.analysis.compare import compare_dumps
    from msprobe_engine.analysis.report import RowWriter

    baseline = _rss_mb()
    start, cpu = time.perf_counter(), time.process_time()
    with RowWriter(root / "compare.csv") as writer:
        comp = compare_dumps(root / "a", root / "b", on_row=writer.write, keep_rows=False, progress=False)
    return {"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "baseline_rss_mb": baseline,
            "peak_rss_mb": _peak_rss_mb(), "counts": comp.ranks[0].counts}


PHASES = {"read": phase_read, "raw": phase_raw, "compare": phase_compare}


def _run_phase(phase: str, root: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", phase, "--dir", str(root)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=500)
    parser.add_argument("--size-mb", type=float, default=1024, help="total size of both dumps")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the three phases (medians are reported)")
    parser.add_argument("--dir", type=Path, help="work directory (default: a temporary one, removed after)")
    parser.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(PHASES[args.phase](args.dir)))
        return
    runs: dict[str, list[dict]] = {phase: [] for phase in PHASES}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        largest_pair = generate(root, args.entries, args.size_mb)
        print(f"generated {args.entries} entries x 2 dumps, {args.size_mb:g} MB, in {time.perf_counter() - start:.1f} s")
        for _ in range(args.repeat):
            for phase in PHASES:
                runs[phase].append(_run_phase(phase, root))
    read, raw, compare = (_median(runs[p], "seconds") for p in ("read", "raw", "compare"))
    read_cpu, compare_cpu = _median(runs["read"], "cpu_s"), _median(runs["compare"], "cpu_s")
    peak = max(r["peak_rss_mb"] for r in runs["compare"])
    above = max(r["peak_rss_mb"] - r["baseline_rss_mb"] for r in runs["compare"])
    mib = runs["raw"][0]["bytes"] / 2**20
    print(f"read:     {read:.3f} s (cpu {read_cpu:.3f} s): torch.load(weights_only=True) of every file, {mib:.0f} MiB")
    print(f"compare:  {compare:.3f} s (cpu {compare_cpu:.3f} s), {compare / read:.2f}x the read, statuses "
          f"{runs['compare'][0]['counts']}")
    print(f"raw read: {raw:.3f} s (bytes only, page cache warm); compare is {compare / raw:.1f}x that")
    print(f"peak RSS: {peak:.0f} MiB, {above:.0f} MiB above the process after imports; "
          f"largest tensor pair {largest_pair / 2**20:.0f} MiB")
    print(json.dumps({"compare_over_read": round(compare / read, 3), "compare_s": round(compare, 3),
                      "read_s": round(read, 3), "read": "torch.load(weights_only=True) of every .pt file",
                      "compare_cpu_s": round(compare_cpu, 3), "read_cpu_s": round(read_cpu, 3),
                      "compare_over_read_cpu": round(compare_cpu / read_cpu, 3),
                      "raw_read_s": round(raw, 3), "compare_over_raw_read": round(compare / raw, 2),
                      "repeat": args.repeat, "dump_mb": round(mib, 1), "peak_rss_mb": round(peak, 1),
                      "rss_over_baseline_mb": round(above, 1), "largest_pair_mb": round(largest_pair / 2**20, 1)}))


if __name__ == "__main__":
    main()
