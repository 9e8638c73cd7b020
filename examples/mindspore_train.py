"""Train a small MindSpore classifier on CPU with the monitor on, and inject a nan into one Cell.

    OMP_NUM_THREADS=1 python -m examples.mindspore_train            # Model.train + MonitorCallback
    OMP_NUM_THREADS=1 python -m examples.mindspore_train --loop     # a value_and_grad loop (two lines)
    OMP_NUM_THREADS=1 python -m examples.mindspore_train --graph    # GRAPH_MODE: statistics from inside the graph
    OMP_NUM_THREADS=1 python -m examples.mindspore_train --inject-step -1   # no fault

At `--inject-step` the Cell `fault` starts multiplying its input by nan; the
monitor's non_finite alert names it. Then: `tensorboard --logdir <output-dir>`.
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mindspore as ms  # noqa: E402
import mindspore.dataset as ds  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import Parameter, Tensor, nn, ops  # noqa: E402
from mindspore.train import Callback, Model  # noqa: E402

from msprobe_engine.config import load_config  # noqa: E402
from msprobe_integrations.mindspore import MindSporeMonitor, MonitorCallback  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "mindspore"
FEATURES, CLASSES, BATCH = 16, 4, 32


class Scale(nn.Cell):
    """Multiplies by a fixed scale: 1, or nan once a fault is injected (in any mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = Parameter(Tensor(1.0, ms.float32), requires_grad=False)

    def construct(self, x):
        return x * self.scale

    def inject_nan(self) -> None:
        ops.assign(self.scale, Tensor(float("nan"), ms.float32))


class Classifier(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(FEATURES, 64)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Dense(64, 64)
        self.act2 = nn.Tanh()
        self.fault = Scale()
        self.head = nn.Dense(64, CLASSES)

    def construct(self, x):
        return self.head(self.fault(self.act2(self.fc2(self.act1(self.fc1(x))))))


def batches(steps: int, seed: int = 0):
    """Synthetic batches: the label is the arg-max of a fixed random projection of x."""
    rng = np.random.default_rng(seed)
    projection = rng.standard_normal((FEATURES, CLASSES))
    for _ in range(steps):
        x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
        yield x, (x @ projection).argmax(1).astype(np.int32)


class Injector(Callback):
    """Injects the fault before step `at` (Model.train)."""

    def __init__(self, fault: Scale, at: int) -> None:
        super().__init__()
        self.fault, self.at = fault, at

    def on_train_step_begin(self, run_context) -> None:
        if run_context.original_args().cur_step_num - 1 == self.at:
            self.fault.inject_nan()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--inject-step", type=int, default=30, help="-1: no fault")
    parser.add_argument("--loop", action="store_true", help="a value_and_grad loop instead of Model.train")
    parser.add_argument("--graph", action="store_true", help="GRAPH_MODE instead of PyNative")
    parser.add_argument("--config", default=None, help="monitor config (default: configs/mindspore/*.yaml)")
    parser.add_argument("--output-dir", default="./mindspore_output")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE if args.graph else ms.PYNATIVE_MODE)
    ms.set_seed(0)
    config = load_config(args.config or CONFIGS / ("graph_mode.yaml" if args.graph else "monitor.yaml"))
    config.output_dir = args.output_dir
    net = Classifier()
    fault = net.fault
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-3)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    if args.loop:
        def forward(x, y):
            return loss_fn(net(x), y)

        grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)
        monitor = MindSporeMonitor(net, optimizer, config)            # line 1
        for step, (x, y) in enumerate(batches(args.steps)):
            if step == args.inject_step:
                fault.inject_nan()
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            optimizer(grads)
            monitor.step_end(loss, grads)                               # line 2
        monitor.close()
    else:
        # GRAPH_MODE: a train network that returns its gradients lets the callback see them
        train_net = (nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer, return_grad=True)
                     if args.graph else None)
        model = Model(train_net) if train_net is not None else Model(net, loss_fn, optimizer)
        callback = MonitorCallback(net, optimizer, config=config)
        data = ds.GeneratorDataset(lambda: batches(args.steps), ["x", "y"], shuffle=False)
        model.train(1, data, callbacks=[Injector(fault, args.inject_step), callback], dataset_sink_mode=False)
        monitor = callback.monitor

    history = list(monitor.monitor.history)
    alerts = [a for record in history for a in record.alerts if a.phase == "start"]
    print(f"{monitor.monitor.records_written} monitored steps; last loss "
          f"{history[-1].metrics.get('train/loss', float('nan')):.4f}")
    for alert in alerts:
        print(f"alert {alert.rule} at step {alert.step}: {alert.tag} = {alert.value:g}")
    print(f"tensorboard --logdir {args.output_dir}")


if __name__ == "__main__":
    main()
