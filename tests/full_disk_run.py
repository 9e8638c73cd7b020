"""Run a monitor whose files cannot grow past a few kilobytes (RLIMIT_FSIZE: every write
beyond fails, as on a full disk), for tests/test_output_problems.py. Prints one JSON line."""
import json
import logging
import resource
import signal
import sys

import torch

from health_models import Teacher, build, train
from msprobe_engine.monitor import Monitor

out, limit = sys.argv[1], int(sys.argv[2])
logging.basicConfig(level=logging.WARNING, format="%(message)s")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
model = build()
optimizer = torch.optim.Adam(model.parameters(), 1e-3)
monitor = Monitor({"output_dir": out, "sinks": ["tensorboard", "jsonl", "csv"], "incidents": {"enabled": False},
                   "control": {"enabled": False}}).attach(model, optimizer)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
train(model, monitor, 30, optimizer, teacher=Teacher())
monitor.close()
last = monitor.history[-1].metrics
print(json.dumps({"failures": monitor.writer.failures, "health": {k: v for k, v in last.items() if k.startswith("writer/")}}))
