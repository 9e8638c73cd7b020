"""Plain PyTorch, on one process or data-parallel: one line after the model and optimizer exist.

    monitor = TorchMonitor(model, optimizer, config="configs/minimal.yaml")
    for batch in data:
        loss = train_step(batch)      # forward, backward, optimizer.step()
        monitor.step_end(loss)

`loss = monitor.run_step(train_step, batch)` instead makes an anomalous step
replayable (docs/incidents.md). A `skip` rule makes `optimizer.step()` a no-op
for that step; a `stop` rule raises `TrainingStopped` out of it.

Micro-steps are counted on the root module's forward; gradients are read
in the optimizer's pre-step hook (the accumulation boundary).

On several ranks (docs/distributed.md) the model may be a `DistributedDataParallel` or
an FSDP2 (`fully_shard`, also HSDP) model: statistics are merged exactly over the ranks
in one all-gather per monitored step and rank 0 writes (every rank with `per_rank`).
`monitor.report_grad_norm(norm, max_norm)` lets the `misreported_grad_norm` rule check
the training's own norm; a `replica_drift` rule compares the replicas' parameters.
"""
from __future__ import annotations

from typing import Any

from msprobe_engine.config import ConfigSource, load_config
from msprobe_engine.contract import Integration
from msprobe_engine.monitor import Monitor


class TorchMonitor(Integration):
    """A `Monitor` attached to a torch model and torch.optim optimizer; the monitor's facade
    (`step_end`, `run_step`, `report_loss`, `report_grad_norm`, `history`, `state_dict`, ...)
    is reached through it."""

    def __init__(self, model: Any, optimizer: Any = None, config: ConfigSource = None, **kwargs: Any) -> None:
        import torch

        from msprobe_engine.frameworks.torch import backend
        from msprobe_engine.frameworks.torch.data_parallel import DataParallelMerge, not_merged_warning, wrapping_of
        from msprobe_engine.frameworks.torch.fsdp import LocalShards

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TorchMonitor: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("TorchMonitor: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}; pass None to monitor the model only")
        wrapping = wrapping_of(model)
        if wrapping.kind in ("ddp", "fsdp2"):
            config = load_config(config)
            params = [(n, p) for n, p in wrapping.inner.named_parameters() if p.requires_grad]
            kwargs.setdefault("reducer", DataParallelMerge(wrapping, params, config.per_rank))
            kwargs.setdefault("backend", LocalShards(backend))
            kwargs.setdefault("rank", torch.distributed.get_rank())
            layout = {"dp": wrapping.world, "wrapping": wrapping.kind}
            if wrapping.tp_group is not None:
                layout["tp"] = torch.distributed.get_world_size(wrapping.tp_group)
            kwargs.setdefault("layout", layout)
        elif wrapping.kind == "unknown":  # (DTensors, e.g. of tensor parallelism: this rank's pieces)
            kwargs.setdefault("backend", LocalShards(backend))
        super().__init__(Monitor(config, **kwargs).attach(wrapping.inner, optimizer))
        self.wrapping = wrapping
        if wrapping.kind == "unknown":
            self.monitor.warn(not_merged_warning(wrapping, self.monitor.rank))
        # per_rank: the rules see each rank's own activations and loss; the skip/stop decision is made
        # collective (DataParallelMerge.agree), but incidents stay per rank, and a rank replaying a
        # step alone would wait for the others in the step's collectives: no replay then
        config = self.monitor.config
        if (wrapping.kind in ("ddp", "fsdp2") and config.per_rank and config.incidents.enabled
                and config.incidents.replay.enabled):
            self.monitor.forgo_replay("per_rank under data parallelism: steps are not replayed (a rank whose own "
                                      "rows fired would replay the step alone, and its collectives would wait for "
                                      "the others)")
        self._install_replica_check(wrapping, optimizer)

    def _install_replica_check(self, wrapping: Any, optimizer: Any) -> None:
        from msprobe_engine.frameworks.torch.replica_drift import ReplicaDriftCheck

        rule = next((r for r in self.monitor.config.alerts if r.rule == "replica_drift"), None)
        if rule is None:
            return
        if wrapping.kind not in ("ddp", "fsdp2") or optimizer is None:
            self.monitor.warn("replica_drift: needs a DistributedDataParallel or fully_shard model on several "
                              "ranks and its optimizer; there are no replicas to compare here")
            return
        if wrapping.tp_group is not None:
            self.monitor.warn("replica_drift: not checked under tensor parallelism (fully_shard on the data "
                              "dimension of a (data, tensor) mesh keeps one copy of each data-parallel shard)")
            return
        if wrapping.kind == "fsdp2" and wrapping.mesh.ndim == 1:
            self.monitor.warn("replica_drift: fully_shard on a 1-D mesh keeps one copy of each shard; there are "
                              "no replicas to compare (HSDP's 2-D mesh has them)")
            return
        params = [(n, p) for n, p in wrapping.inner.named_parameters() if p.requires_grad]
        self.replica_check = ReplicaDriftCheck(self.monitor, optimizer, params, wrapping.mesh, wrapping.group,
                                               rule.every, rule.bucket_numel)
        self.monitor.add_attachment(self.replica_check)
