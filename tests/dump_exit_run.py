"""A dump run as the predecessor's users write it (start(model)/stop()/step() each step, no
close()), for tests/test_dump_durability.py. Usage:

    python dump_exit_run.py <dump_path> <task> <steps> <usage> [<fsize limit>] [<json config overrides>] [<width>]

`usage`: ``steps`` (start/stop/step), ``scope`` (step_scope), ``raise`` (an exception leaves the
loop in the last step), ``forever`` (steps until a signal ends the process). After each
``step()`` the child prints the number of steps it closed; at exit one JSON line with the
session's counters, from an atexit handler registered before the session's own (so it runs
after the session was closed at exit).
"""
import atexit
import json
import logging
import resource
import signal
import sys

import torch

from msprobe_engine.dump import PrecisionDebugger

dump_path, task, steps, usage = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
limit = int(sys.argv[5]) if len(sys.argv) > 5 else 0
overrides = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
width = int(sys.argv[7]) if len(sys.argv) > 7 else 512
logging.basicConfig(level=logging.WARNING, format="%(message)s")
torch.set_num_threads(1)
torch.manual_seed(0)
# six 512-wide Linear+GELU layers: tensor files large enough that the writer is busy at exit
model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
x = torch.randn(32, width)


def report() -> None:
    print(json.dumps({"steps_written": debugger.steps_written, "dropped_steps": debugger.dropped_steps,
                      "drop_reasons": debugger.drop_reasons}), flush=True)


atexit.register(report)
debugger = PrecisionDebugger({"task": task, "dump_path": dump_path, "level": "mix", **overrides})
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
step = 0
while usage == "forever" or step < steps:
    if usage == "scope":
        with debugger.step_scope(model):
            model(x).sum().backward()
    else:
        debugger.start(model)
        model(x).sum().backward()
        if usage == "raise" and step == steps - 1:
            raise RuntimeError("the training loop failed")
        debugger.stop()
        debugger.step()
    step += 1
    print(step, flush=True)
