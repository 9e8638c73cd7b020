"""DeepSpeed: one line after `deepspeed.initialize`, nothing else changes in the loop.

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    monitor = DeepSpeedMonitor(engine, config="configs/deepspeed/monitor.yaml")
    # or DeepSpeedMonitor(engine): the "msprobe" block of ds_config (our config's keys), the
    # way DeepSpeed's own "tensorboard": {...} block turns its monitor on
    for batch in data:
        loss = engine(batch)
        engine.backward(loss)     # the loss is reported from here
        engine.step()             # gradients before, optimizer state after, then step_end
    monitor.close()

What is read, and where (ZeRO 0/1/2/3; fp32, bf16, fp16):
- activations: forward hooks on `engine.module` (names without the engine prefix);
  a micro-step is one forward of `engine.module`;
- expert parameters of DeepSpeed MoE layers with `ep_size > 1`: under their global expert number
  (`moe.deepspeed_moe.experts.deepspeed_experts.<e>`, as DeepSpeed's MoE checkpoints), every expert
  listed on every rank (`experts`); the experts' own activations are not measured then;
- router health (`watch.routers`): forward hooks on DeepSpeed MoE's `TopKGate`s
  (`deepspeed.moe.sharded_moe`, see `routers`) and on transformers' routers;
- parameter gradients: once per optimizer step, at the accumulation boundary
  before `engine.step()`, divided by the fp16 loss scale (before clipping);
- fp32 parameters and optimizer state (exp_avg, exp_avg_sq): after the step, with
  DeepSpeed's own `engine.get_global_grad_norm()` as `train/reported_grad_norm` (checked by
  the `misreported_grad_norm` rule against the merged norm).
Each rank measures only its own pieces (ZeRO shards; ZeRO-0 replicas split
between the ranks) and one all-gather per monitored step merges the partial
statistics over the data-parallel group (`msprobe_integrations.deepspeed.merge`);
no full parameter is gathered. Rank 0 writes the merged run; with
`per_rank: true` every rank writes its own (its own loss and activations).

A `PipelineEngine` (`engine.train_batch(data_iter)`, pipeline x data parallel): one monitored step per
`train_batch`, a micro-step per micro-batch; each stage measures its own layers, named by the
`PipelineModule`'s global layer index (`2.weight` on whichever stage holds layer 2), around the
schedule's optimizer step; the loss is the last stage's. Every rank's rows are completed with empty
placeholders of the other stages' and merged over all the pipeline's ranks (`pipeline`), so every rank
holds the whole model's statistics and rank 0 writes them.

Alert actions are applied in `engine.step()` (`hooks.EngineHooks`): `skip` runs DeepSpeed's
step with the torch optimizer's and lr scheduler's `step` as no-ops, `stop` raises
`TrainingStopped` before it; fp16 overflow steps are screened out of the decision.

DeepSpeed names relied on. Public: `DeepSpeedEngine.backward/step/get_global_grad_norm/
is_gradient_accumulation_boundary/was_step_applied/managed_gradient_accumulation/
zero_optimization_stage/fp16_enabled/global_steps/train_batch_size/module/optimizer/monitor`,
`deepspeed.utils.safe_get_local_grad/safe_get_local_fp32_param/
safe_get_local_optimizer_state` (ZeRO-3), ZeRO-3 parameter attributes `ds_numel`,
`ds_process_group`, `partition_numel()`. Not public (checked against 0.19.8):
`engine.seq_data_parallel_group` / `engine.data_parallel_group`, `engine.mpu`,
`engine.device`, `optimizer.loss_scale`, `optimizer.optimizer` (the wrapped torch optimizer);
ZeRO-1/2 and BF16_Optimizer: `param._hp_mapping` (`get_lp_grad_fragment`,
`get_hp_fragment`, `lp_fragment_address`) and `param._index_in_param_group`, the
links DeepSpeed's own `safe_get_full_*` helpers use; ZeRO-0 fp16/bf16
(`FP16_UnfusedOptimizer`): `fp16_groups` / `fp32_groups`; MoE: `deepspeed.moe.sharded_moe.TopKGate`
(`wg`, `k`, `drop_tokens`, and what its forward returns), `MOELayer` (`ep_size`, `ep_group`,
`ep_group_name`, `num_local_experts`), `experts.deepspeed_experts`,
`deepspeed.utils.groups._get_expert_data_parallel_group`, `deepspeed.moe.utils.is_moe_param`;
`PipelineEngine`: `_take_model_step`, `fwd_outputs`, `is_last_stage()`,
`grid.get_slice_parallel_world_size()`, `module.tied_modules`, `module.tied_comms` (`ranks`).

Not supported: a `PipelineEngine` with a model-parallel dimension (an error), optimizer wrappers
other than those above (a warning; activations and loss are still monitored).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from msprobe_engine.config import ConfigError, ConfigSource, MonitorConfig, load_config
from msprobe_engine.config.loader import from_dict
from msprobe_engine.contract import Integration
from msprobe_engine.monitor import Monitor

__all__ = ["DeepSpeedMonitor"]


class DeepSpeedMonitor(Integration):
    """A `Monitor` wired into a DeepSpeed engine (see the module docstring); the monitor's
    facade (`step_end`, `close`, `history`, `state_dict`, ...) is reached through it.

    `engine_monitor=True` also sends every step's metrics through `engine.monitor`
    (DeepSpeed's own TensorBoard/CSV/W&B monitor, when its config enables one), at
    DeepSpeed's x-axis (samples).

    `start_step`: the monitor's number of the engine's next optimizer step (default
    `engine.global_steps`; the HF Trainer's callback passes its `global_step + 1`).
    """

    def __init__(self, engine: Any, config: ConfigSource = None, *, engine_monitor: bool = False,
                 start_step: int | None = None) -> None:
        _check_engine(engine)
        import torch.distributed as dist
        from deepspeed.runtime.pipe.engine import PipelineEngine

        from msprobe_engine.frameworks.torch import backend as torch_backend
        from msprobe_engine.frameworks.torch.module_hooks import ModuleHooks
        from msprobe_engine.frameworks.torch.router_hooks import attach_routers
        from msprobe_integrations.deepspeed.experts import EXPERT_MODULES, expert_layers
        from msprobe_integrations.deepspeed.hooks import EngineHooks, norm_not_comparable
        from msprobe_integrations.deepspeed.merge import RankMerge
        from msprobe_integrations.deepspeed.pipeline import PipelineMerge, tied_copies
        from msprobe_integrations.deepspeed.routers import attach_gates
        from msprobe_integrations.deepspeed.shards import Placed, shard_reader

        config = load_config(config if config is not None else ds_config_block(engine))
        distributed = dist.is_initialized()
        group = getattr(engine, "seq_data_parallel_group", None) or engine.data_parallel_group
        dp_rank, dp_world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
        pipeline = isinstance(engine, PipelineEngine)
        # a pipeline's stages hold different layers: merged over all its ranks (`pipeline`)
        reducer = (PipelineMerge if pipeline else RankMerge)(None if pipeline else group, per_rank=config.per_rank)
        layers = expert_layers(engine.module, dp_world) if distributed else []
        if layers:  # EP > 1: the experts' own activations are other ranks' tokens
            modules = dataclasses.replace(config.modules, exclude_regex=[*config.modules.exclude_regex, EXPERT_MODULES])
            config = dataclasses.replace(config, modules=modules)
        # steps follow DeepSpeed's, also after a resume
        start_step = engine.global_steps if start_step is None else start_step
        self._step_offset = start_step - engine.global_steps
        monitor = Monitor(config, rank=dist.get_rank() if distributed else 0, backend=torch_backend,
                          reducer=reducer, start_step=start_step)
        super().__init__(monitor)
        self.engine = engine
        if engine.mpu is not None and not pipeline:
            monitor.warn("model parallelism is set: statistics are merged over the data-parallel group "
                         "only; set per_rank: true to keep every model-parallel rank's records")
        if pipeline and len(engine.module.tied_modules):
            monitor.warn("PipelineModule with tied layers (TiedLayerSpec): the activation rows of "
                         "tied_modules.* merge every stage's uses of the layer in one row")
        if pipeline and config.per_rank and reducer.world > 1:
            monitor.warn("per_rank under a PipelineEngine: each rank's own activation and loss rows of the "
                         "layers other stages hold are empty (numel 0, min/max/mean nan)")
        other_norm = norm_not_comparable(engine)
        if other_norm and any(rule.rule == "misreported_grad_norm" for rule in config.alerts):
            monitor.warn(f"misreported_grad_norm: {other_norm}; it is not checked")
        reader = shard_reader(engine, dp_rank, dp_world, monitor.warn, layers)
        if pipeline and reader is not None:  # a tied layer's parameters: measured on its first stage
            reader = Placed(reader, reader.names, tied_copies(engine, reader.names))
        monitor.add_attachment(ModuleHooks(monitor, engine.module), EngineHooks(monitor, engine, reader),
                               *attach_gates(monitor, engine.module), *attach_routers(monitor, engine.module))
        if engine_monitor:
            self._send_to_engine_monitor()

    def _send_to_engine_monitor(self) -> None:
        engine, monitor = self.engine, self.monitor
        if not engine.monitor.enabled:
            monitor.warn("engine_monitor=True, but the DeepSpeed config enables none of its monitors "
                         "(tensorboard, csv_monitor, wandb, comet): metrics go to our sinks only")
            return
        if monitor.rank != 0:
            return

        def send(record) -> None:
            samples = (record.step - self._step_offset + 1) * engine.train_batch_size()
            events = [(tag, value, samples) for tag, value in record.metrics.items()]
            monitor.writer.submit(lambda: engine.monitor.write_events(events), "DeepSpeed monitor write")

        monitor.step_end_listeners.append(send)


def ds_config_block(engine: Any) -> MonitorConfig | None:
    """The `"msprobe"` block of the engine's DeepSpeed config, validated (None: there is none)."""
    block = engine._config._param_dict.get("msprobe")
    if block is None:
        return None
    if not isinstance(block, dict):
        raise ConfigError(f"DeepSpeed config: \"msprobe\" must be a mapping of our config's keys, "
                          f"got {type(block).__name__}")
    return from_dict(block, origin='DeepSpeed config "msprobe"')


def _check_engine(engine: Any) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError("DeepSpeedMonitor: expected the engine returned by deepspeed.initialize "
                        f"(a deepspeed.DeepSpeedEngine), got {type(engine).__module__}.{type(engine).__name__}; "
                        "for a plain torch model use msprobe_integrations.torch.TorchMonitor")
    if isinstance(engine, PipelineEngine) and engine.grid.get_slice_parallel_world_size() > 1:
        raise NotImplementedError("DeepSpeedMonitor: a PipelineEngine with a model-parallel dimension in its "
                                  "topology is not supported (only pipeline x data parallel)")
