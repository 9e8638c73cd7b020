"""Run a function on N gloo ranks on localhost, with a free port and a timeout.

A rank that hangs or dies fails the calling test instead of hanging the run.
The function must be importable (module-level) and gets (rank, world_size, *args);
what each rank returns comes back as a list indexed by rank.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, env: dict, args: tuple, out) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    try:
        out.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # report every failure, including SystemExit
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 240.0,
              env: dict | None = None) -> list[Any]:
    """Run `fn(rank, world, *args)` in `world` spawned processes; raise on error or timeout."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, env or {}, args, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            try:
                rank, status, value = out.get(timeout=timeout)
            except Exception:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} did not finish "
                                   f"within {timeout}s") from None
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
