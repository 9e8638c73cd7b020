"""Benchmark `graph` on real dumps of the tiny GPT: build + compare time and the output sizes,
against `compare` alone on the same dumps (the graph's comparison is compare's, plus the tree).

    OMP_NUM_THREADS=1 python bench/graph.py [--layers 12] [--level mix] [--repeat 3]

Dumps one step of the tiny GPT (``--layers`` blocks) twice (seeds 0 and 1, so every node
differs), then times, ``--repeat`` rounds each, `compare_dumps` alone and `build_graphs` +
`write_outputs` (.vis.db, HTML, summary). Figures are medians in seconds; the last line
printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

import dump_helpers  # noqa: E402
from examples.tiny_gpt import GPTConfig  # noqa: E402
from msprobe_engine.analysis.compare import compare_dumps  # noqa: E402
from msprobe_engine.analysis.graph import build_graphs, write_outputs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--level", default="mix", choices=["L0", "mix"])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    dump_helpers.SMALL = GPTConfig(vocab=64, dim=32, heads=2, layers=args.layers, seq=16, batch=2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a = dump_helpers.tiny_gpt_dump(root / "a", 1, args.level, seed=0)
        b = dump_helpers.tiny_gpt_dump(root / "b", 1, args.level, seed=1)
        compare_s, graph_s = [], []
        for i in range(args.repeat):
            start = time.perf_counter()
            compare_dumps(a, b, keep_rows=False, progress=False)
            compare_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            result = build_graphs(b, a)
            files = write_outputs(result, root / f"out{i}")
            graph_s.append(time.perf_counter() - start)
        figures = {"level": args.level, "layers": args.layers, "nodes": len(result.targets[0].nodes),
                   "compare_s": round(statistics.median(compare_s), 3),
                   "graph_s": round(statistics.median(graph_s), 3),
                   "graph_over_compare": round(statistics.median(graph_s) / statistics.median(compare_s), 2),
                   "vis_db_kib": files["vis_db"].stat().st_size // 1024, "html_kib": files["html"].stat().st_size // 1024}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
