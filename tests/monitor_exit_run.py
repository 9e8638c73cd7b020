"""A monitored run that ends without `Monitor.close()`, for tests/test_monitor_durability.py:

    python monitor_exit_run.py <out> <steps> <usage> [<json config overrides>]

`usage`: ``steps`` (`steps` steps, then the script ends), ``raise`` (an exception leaves the
loop after the last step's optimizer step, before its `step_end`), ``forever`` (steps until a
signal ends the process; a `signal_at` rule in the config sends one from inside a step end).
After each `step_end` the child prints the number of steps it
ended; a sink sleeps 50 ms per record, so the writer is behind when the loop ends. At exit one JSON line with the records emitted and the writer's losses, from an atexit
handler registered before the monitor's own (so it runs after the monitor was closed at exit).
"""
import atexit
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch

from health_models import Teacher, build
from sink_helpers import EVERY_TAG_TENSORBOARD
from msprobe_engine.monitor import Monitor
from msprobe_engine.rules.base import Rule, register_rule
from msprobe_engine.sinks.base import Sink, register_sink

out, steps, usage = sys.argv[1], int(sys.argv[2]), sys.argv[3]
overrides = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
logging.basicConfig(level=logging.WARNING, format="%(message)s")
torch.set_num_threads(1)


def report() -> None:
    print(json.dumps({"records_written": monitor.records_written, "dropped": monitor.writer.dropped,
                      "failures": monitor.writer.failures}), flush=True)


@register_sink("slow")
class SlowSink(Sink):
    """A sink slower than the training (a network file system): the writer is behind at exit."""

    def write(self, record) -> None:
        time.sleep(0.05)


@register_rule("signal_at")
class SignalAt(Rule):
    """Sends this process `signum` from inside the step end of its `step`-th evaluation, while
    that step's record is being made (a scheduler's SIGTERM landing in `step_end`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Rule.Config):
        step: int = 5
        signum: int = 15

    def __init__(self, config: "SignalAt.Config") -> None:
        super().__init__(config)
        self.evaluated = 0

    def evaluate(self, table, stats, metrics) -> list:
        if self.evaluated == self.config.step:
            os.kill(os.getpid(), self.config.signum)
        self.evaluated += 1
        return []


atexit.register(report)
model = build()
optimizer = torch.optim.Adam(model.parameters(), 1e-3)
monitor = Monitor({"output_dir": out, "run_name": "run", "sinks": ["slow", EVERY_TAG_TENSORBOARD, "jsonl", "csv"],
                   "writer": {"when_full": "wait"}, "incidents": {"enabled": False}, "control": {"enabled": False},
                   **overrides}).attach(model, optimizer)
teacher = Teacher()
step = 0
while usage == "forever" or step < steps:
    x, y = teacher.batch()
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # the monitor's optimizer hooks decide here (before_optimizer_step)
    if usage == "raise" and step == steps - 1:
        raise RuntimeError("the training loop failed")
    monitor.step_end(loss)
    step += 1
    print(step, flush=True)
