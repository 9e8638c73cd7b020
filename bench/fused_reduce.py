"""The fused Triton reduction kernel against the torch path, per monitored step, on CUDA.

    python bench/fused_reduce.py [--reps 50] [--workloads gpt2_grads,many_small,few_large,one_hook]

A "step" is what the monitor measures at one moment: `backend.partial_stats(tensors,
count_zeros)` then `backend.concat` (the rows, packed, left on the device). Workloads:

- `gpt2_grads`: the parameter shapes of a 12-layer, 768-wide GPT-2 (148 tensors, 124M elements),
  in float32 and in bfloat16;
- `many_small`: 2000 tensors of 64 to 4096 elements (activations of small modules), float32 and bf16;
- `few_large`: 8 tensors of 16M elements, float32 and bf16;
- `one_hook`: the 2 tensors of one module hook (8 x 512 x 768 each), where launch overhead
  decides: the case that says whether the kernel should take calls of one or two tensors.

For each, with the kernel (`fused_reduce.DEVICES = ("cuda",)`) and without (the torch path on
CUDA): the host time of the call (what the training thread spends launching), and the time
until the device is done (host time of call + `torch.cuda.synchronize()`), medians over
`--reps` after warm-up; both modes' rows compared (largest relative difference). Each mode runs
with and without the zero count. The last line printed is one JSON object. Without CUDA it prints
that it needs CUDA (as JSON) and exits 0; ``TRITON_INTERPRET=1 python bench/fused_reduce.py
--dry-run-on-cpu --reps 2`` runs small workloads through the interpreter to check the script.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from msprobe_engine.frameworks.torch import backend, fused_reduce  # noqa: E402


def gpt2_shapes(layers: int = 12, dim: int = 768, vocab: int = 50257, context: int = 1024) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, dim), (context, dim)]
    for _ in range(layers):
        shapes += [(dim,), (dim,), (dim, 3 * dim), (3 * dim,), (dim, dim), (dim,), (dim,), (dim,),
                   (dim, 4 * dim), (4 * dim,), (4 * dim, dim), (dim,)]
    return shapes + [(dim,), (dim,)]


def workload(name: str, dtype: torch.dtype, gen: torch.Generator, device: str, small: bool) -> list[torch.Tensor]:
    if name == "gpt2_grads":
        shapes = gpt2_shapes(layers=1, dim=64, vocab=500, context=64) if small else gpt2_shapes()
    elif name == "many_small":
        sizes = torch.randint(64, 4097, (20 if small else 2000,), generator=gen).tolist()
        shapes = [(n,) for n in sizes]
    elif name == "one_hook":
        shapes = [(2, 16, 64)] * 2 if small else [(8, 512, 768)] * 2
    elif name == "few_large":
        shapes = [(70_000 if small else 16 << 20,)] * (2 if small else 8)
    else:
        raise SystemExit(f"unknown workload {name!r}")
    return [torch.randn(shape, generator=gen).to(device, dtype) for shape in shapes]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def one_step(tensors: list[torch.Tensor], count_zeros: bool) -> torch.Tensor:
    return backend.concat([backend.partial_stats(tensors, count_zeros=count_zeros, deferred=True)])


def timed(tensors: list[torch.Tensor], count_zeros: bool, fused: bool, reps: int) -> dict:
    device = tensors[0].device.type
    fused_reduce.DEVICES = (device,) if fused else ()
    for _ in range(3):  # warm-up: Triton compiles, the caching allocators fill
        rows = one_step(tensors, count_zeros)
    sync(device)
    host, done = [], []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        rows = one_step(tensors, count_zeros)
        launched = time.perf_counter()
        sync(device)
        end = time.perf_counter()
        host.append((launched - start) * 1e3)
        done.append((end - start) * 1e3)
    return {"host_ms": round(statistics.median(host), 4), "done_ms": round(statistics.median(done), 4),
            "rows": rows.cpu()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--workloads", default="gpt2_grads,many_small,few_large,one_hook")
    parser.add_argument("--dry-run-on-cpu", action="store_true",
                        help="with TRITON_INTERPRET=1: small workloads on CPU tensors in Triton's interpreter, "
                             "to check this script (its timings mean nothing)")
    args = parser.parse_args()
    device = "cpu" if args.dry_run_on_cpu else "cuda"
    if args.dry_run_on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--dry-run-on-cpu needs TRITON_INTERPRET=1 in the environment")
    if device == "cuda" and not torch.cuda.is_available():
        print("bench/fused_reduce.py needs a CUDA device (the kernel is for CUDA; its CPU check is "
              "tests/test_fused_reduce.py, in Triton's interpreter)")
        print(json.dumps({"skipped": "needs CUDA", "cuda": False}))
        return 0
    if not fused_reduce.available():
        print(json.dumps({"skipped": f"fused kernel unavailable: {fused_reduce.disabled_reason}",
                          "cuda": device == "cuda"}))
        return 0
    gen = torch.Generator().manual_seed(0)
    results = {}
    print(f"{'workload':<32}{'zeros':>6}{'tensors':>9}{'torch host':>12}{'fused host':>12}"
          f"{'torch done':>12}{'fused done':>12}{'speed-up':>10}{'max rel diff':>14}")
    for name in args.workloads.split(","):
        for dtype in (torch.float32, torch.bfloat16):
            tensors = workload(name, dtype, gen, device, small=args.dry_run_on_cpu)
            for count_zeros in (False, True):
                plain = timed(tensors, count_zeros, fused=False, reps=args.reps)
                fused = timed(tensors, count_zeros, fused=True, reps=args.reps)
                a, b = fused.pop("rows").double(), plain.pop("rows").double()
                finite = torch.isfinite(a) & torch.isfinite(b)
                rel = ((a - b).abs() / b.abs().clamp_min(1e-30))[finite].max().item() if finite.any() else 0.0
                same_nonfinite = bool(torch.equal(torch.isnan(a), torch.isnan(b)))
                key = f"{name}/{str(dtype).split('.')[-1]}/zeros={count_zeros}"
                speedup = plain["done_ms"] / fused["done_ms"] if fused["done_ms"] else float("nan")
                results[key] = {"tensors": len(tensors), "elements": sum(t.numel() for t in tensors),
                                "torch": plain, "fused": fused, "speedup_done": round(speedup, 3),
                                "host_ratio": round(plain["host_ms"] / fused["host_ms"], 3),
                                "max_rel_diff": rel, "same_nan_layout": same_nonfinite}
                print(f"{key:<32}{str(count_zeros):>6}{len(tensors):>9}{plain['host_ms']:>12.3f}"
                      f"{fused['host_ms']:>12.3f}{plain['done_ms']:>12.3f}{fused['done_ms']:>12.3f}"
                      f"{speedup:>10.2f}{rel:>14.2e}")
            del tensors
            if device == "cuda":
                torch.cuda.empty_cache()
    fused_reduce.DEVICES = ("cuda",)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter, dry run)"
    print(json.dumps({"cuda": device == "cuda", "device": name, "torch": torch.__version__,
                      "reps": args.reps, "fused_enabled": fused_reduce.ENABLED, "results": results,
                      "load": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
