"""MindSpore data parallelism on CPU: two workers under `msrun` (MindSpore 2.10), each with its own
micro-batch, gradients reduced by `nn.DistributedGradReducer`. The monitor's statistics are
those of the whole global batch on every rank; with `per_rank` each rank's activations are its
own, and a skip one rank's rules decide holds on every rank. The workers run with `import torch`
blocked.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.sink_helpers import untimed

from msprobe_engine.stats import finalize, reference_partial

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
WORKER = '''
import json, sys

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this worker")

sys.meta_path.insert(0, BlockTorch())
sys.path.insert(0, sys.argv[2])
import mindspore as ms
import numpy as np
from mindspore import Tensor, nn
from mindspore.communication import get_rank, init

from msprobe_integrations.mindspore import MindSporeMonitor

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)
init()
rank, out = get_rank(), sys.argv[1]
ms.set_seed(0)
net = nn.SequentialCell(nn.Dense(6, 8), nn.Tanh(), nn.Dense(8, 3))
opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
reducer = nn.DistributedGradReducer(opt.parameters, mean=True, degree=2)
loss_fn = nn.MSELoss()
grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
seen = {}


def keep(cell, args, output):  # returns None: the output stays the Cell's
    seen.setdefault("fc1", output.asnumpy())


net[0].register_forward_hook(keep)
histories = {}
for per_rank in (False, True):
    seen.clear()
    config = {"output_dir": f"{out}/{per_rank}", "strict": True, "sinks": ["jsonl"], "per_rank": per_rank,
              "stats": ["min", "max", "mean", "norm"],
              "watch": {"module_outputs": True, "param_grads": True, "optimizer_state": ["exp_avg"]}}
    monitor = MindSporeMonitor(net, opt, config)
    rng = np.random.default_rng(rank + 10 * per_rank)
    x, y = (Tensor(rng.standard_normal(shape).astype(np.float32)) for shape in ((4, 6), (4, 3)))
    loss, grads = grad_fn(x, y)
    grads = reducer(grads)
    opt(grads)
    record = monitor.step_end(loss, grads)
    monitor.close()
    histories[str(per_rank)] = record.metrics
    np.savez(f"{out}/seen{rank}_{per_rank}.npz", fc1=seen["fc1"], grad=grads[0].asnumpy(), loss=loss.asnumpy(),
             exp_avg=opt.moment1[0].asnumpy())
# per_rank with a skip rule: only rank 0's batch holds a nan, so only its rules fire; the reduced
# gradients are nan on both ranks, and the ranks agree to skip: no rank applies the step
monitor = MindSporeMonitor(net, opt, {"output_dir": f"{out}/agree", "strict": True, "per_rank": True,
                                      "sinks": ["jsonl"], "alerts": [{"rule": "non_finite", "action": "skip"}],
                                      "watch": {"module_outputs": True, "param_grads": False, "optimizer_state": []}})
before = [p.asnumpy().copy() for p in net.trainable_params()]
x_bad = x.asnumpy().copy()
x_bad[0, 0] = np.nan if rank == 0 else x_bad[0, 0]
loss, grads = grad_fn(Tensor(x_bad), y)
opt(reducer(grads))
monitor.step_end(loss)
monitor.close()
histories["agree"] = {"unchanged": all(np.array_equal(b, p.asnumpy()) for b, p in zip(before, net.trainable_params())),
                      "own_alerts": sorted({a.rule for r in monitor.monitor.history for a in r.alerts})}
# rank 1 watches one Cell more: the layouts differ, and every rank says so instead of merging
watched = {"names": ["0"] if rank == 0 else ["0", "2"]}
monitor = MindSporeMonitor(net, opt, {"output_dir": f"{out}/mismatch", "strict": True, "modules": watched,
                                      "watch": {"module_outputs": True, "param_grads": False, "optimizer_state": []}})
loss, grads = grad_fn(x, y)
opt(reducer(grads))
try:
    monitor.step_end(loss)
    histories["mismatch"] = "merged"
except RuntimeError as exc:
    histories["mismatch"] = str(exc)
json.dump(histories, open(f"{out}/metrics{rank}.json", "w"))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_stats(metrics, prefix, values):
    want = finalize(reference_partial(values))
    for stat in ("min", "max", "mean", "norm"):
        np.testing.assert_allclose(metrics[f"{prefix}/{stat}"], want[stat], rtol=1e-5, atol=1e-7, err_msg=prefix)


def test_statistics_merge_over_the_data_parallel_group_and_per_rank_keeps_each_ranks_own(tmp_path):
    msrun = shutil.which("msrun", path=os.path.dirname(sys.executable))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    result = subprocess.run([msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}",
                             f"--log_dir={tmp_path / 'logs'}", "--join=True", str(script), str(tmp_path), str(ROOT)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    logs = "".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("worker_*.log")))
    assert result.returncode == 0, result.stderr[-2000:] + logs
    metrics = [json.loads((tmp_path / f"metrics{r}.json").read_text()) for r in (0, 1)]
    seen = {(r, p): np.load(tmp_path / f"seen{r}_{p}.npz") for r in (0, 1) for p in (False, True)}

    merged = metrics[0]["False"]
    assert untimed(metrics[1]["False"]) == untimed(merged)  # every rank holds the merged statistics
    assert_stats(merged, "actv/0/output", np.concatenate([seen[0, False]["fc1"], seen[1, False]["fc1"]]))
    np.testing.assert_array_equal(seen[0, False]["grad"], seen[1, False]["grad"])  # reduced: the same on both
    assert_stats(merged, "grad/0.weight", seen[0, False]["grad"])  # taken once, not added up
    assert_stats(merged, "optim/0.weight/exp_avg", seen[0, False]["exp_avg"])
    np.testing.assert_allclose(merged["train/loss"], (seen[0, False]["loss"] + seen[1, False]["loss"]) / 2, rtol=1e-6)
    assert sorted(p.name for p in (tmp_path / "False").iterdir()) == ["rank0"]  # rank 0 writes

    for rank in (0, 1):  # per_rank: each rank's own data, the model state merged
        own = metrics[rank]["True"]
        assert_stats(own, "actv/0/output", seen[rank, True]["fc1"])
        assert_stats(own, "grad/0.weight", seen[rank, True]["grad"])
    assert sorted(p.name for p in (tmp_path / "True").iterdir()) == ["rank0", "rank1"]
    for rank in (0, 1):  # per_rank + skip: the decision of rank 0's rules holds on both ranks
        assert metrics[rank]["agree"]["unchanged"], metrics[rank]["agree"]
    assert metrics[0]["agree"]["own_alerts"] == ["non_finite"] and metrics[1]["agree"]["own_alerts"] == []
    for rank in (0, 1):
        assert "measured different tensors" in metrics[rank]["mismatch"], metrics[rank]["mismatch"]
