"""`MegatronMonitor`: the engine's `Monitor` wired into Megatron-core chunks and optimizer."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.transformer_block import TransformerBlock

from msprobe_engine.frameworks.torch import backend as torch_backend
from msprobe_engine.frameworks.torch.fsdp import LocalShards, shard_groups
from msprobe_engine.frameworks.torch.module_hooks import ModuleHooks
from msprobe_engine.config import ConfigSource, load_config
from msprobe_engine.contract import Integration
from msprobe_engine.monitor import Monitor
from msprobe_engine.stats.table import MetricKey
from msprobe_integrations.megatron.experts import complete_experts, grouped_weights, split_grouped
from msprobe_integrations.megatron.model import describe_problems, num_experts, prefix_if_clashing, unwrap_chunks
from msprobe_integrations.megatron.optim import OptimizerTap, check_optimizer, find_slots
from msprobe_integrations.megatron.parallel import Layout, StatReducer
from msprobe_integrations.megatron.routers import watch_routers
from msprobe_integrations.megatron.tp_split import ReplicaSplit
from msprobe_integrations.megatron.wrapping import MethodWrap

#: the value Megatron's result validation rejected, recorded with the failing step
REJECTED = MetricKey("train", "megatron_rejected")
#: modules whose output is not measured: Megatron's placeholders, and the block of layers
#: (its output is its last layer's or final norm's, and each pipeline stage has one)
UNWATCHED = (IdentityOp, IdentityFuncOp, TransformerBlock)
#: under expert parallelism, each rank runs other experts on other tokens: their activations
#: are not measured (their parameters are, merged; the routers' load says what each expert got)
EXPERT_MODULES = r"\.experts\.local_experts\.\d+(\.|$)"


class MegatronMonitor(Integration):
    """Monitor Megatron-core model chunks and their optimizer (see docs/megatron.md).

    Create it once the model chunks and the optimizer exist, and call
    `step_end(loss)` after each `train_step`. Activations come from module hooks
    on every chunk, gradients from the optimizer's `prepare_grads`, weights and
    optimizer state from its `step`; statistics are merged over the tensor- and
    data-parallel groups with one all-gather each per transfer. Under tensor parallelism each
    replicated activation is measured by one TP rank (`tp_split`). The monitor's facade
    (`history`, `state_dict`, ...) is reached through it.
    """

    def __init__(self, model_chunks: Any, optimizer: Any, config: ConfigSource = None,
                 **kwargs: Any) -> None:
        chunks = unwrap_chunks(model_chunks)
        check_optimizer(optimizer)
        config = load_config(config)
        layout = Layout.of(chunks)
        named = [item for chunk in chunks for item in chunk.named_parameters()]
        slots, sharded, more = find_slots(optimizer, named)
        # torch FSDP2 (TorchFullyShardedDataParallel, over one group: a 1-D mesh, no replicas):
        # DTensors, measured on this rank's shard and merged over the data-parallel group
        dtensors, _ = shard_groups(named)
        sharded |= dtensors
        slots, grouped_problems = split_grouped(slots, chunks, sharded)
        more += grouped_problems
        if layout.ep_size > 1:
            layout.check_experts()
            slots = complete_experts(slots, num_experts(chunks))
            modules = dataclasses.replace(config.modules, exclude_regex=[*config.modules.exclude_regex, EXPERT_MODULES])
            config = dataclasses.replace(config, modules=modules)
        partitioned = {name for name, p in [*named, *((s.name, s.param) for s in slots)]
                       if getattr(p, "tensor_model_parallel", False)}
        kwargs.setdefault("writes", config.per_rank or layout.stage_leader)
        kwargs.setdefault("backend", LocalShards(torch_backend) if dtensors else torch_backend)
        monitor = Monitor(config, reducer=StatReducer(layout, partitioned, sharded),
                          layout={"tp": layout.size(layout.tp_group), "dp": layout.size(layout.dp_group),
                                  "pp": layout.pp_size}, **kwargs)
        super().__init__(monitor)
        if layout.size(layout.tp_group) > 1:  # replicated activations: each measured by one TP rank
            ReplicaSplit(monitor, monitor.reducer, layout.tp_group).install()
        problems = describe_problems(chunks, layout.size(layout.tp_group), layout.size(layout.dp_group),
                                     layout.pp_size, per_expert=set(grouped_weights(chunks)))
        problems += prefix_if_clashing(chunks)
        for problem in problems + more:
            monitor.warn(problem)
        if layout.pp_size > 1 and monitor.decide_early:
            monitor.warn(f"skip/stop rules under {layout.pp_size} pipeline stages: each stage decides on "
                         "its own statistics; a stage that stops leaves the others waiting")
        monitor.add_attachment(*[ModuleHooks(monitor, chunk.module, name_map=chunk.rename, counts_micro_steps=i == 0,
                                             exclude_types=UNWATCHED)
                                 for i, chunk in enumerate(chunks)])
        monitor.add_attachment(*watch_routers(monitor, chunks))
        # Megatron's norm covers every pipeline stage, the monitor's merged one this stage's only
        monitor.add_attachment(OptimizerTap(monitor, optimizer, slots, reports_norm=layout.pp_size == 1))
        if layout.pp_size > 1 and any(rule.rule == "misreported_grad_norm" for rule in config.alerts):
            monitor.warn(f"misreported_grad_norm under {layout.pp_size} pipeline stages: Megatron's grad norm "
                         "covers all stages and the monitor's only this stage's; it is not checked")
        self._watch_validation()

    def _watch_validation(self) -> None:
        """Record the step before Megatron's result validation stops the run: it raises
        (`_on_rejected`), or, re-running steps, asks train_step to exit (`_on_exit_decision`)."""
        machine = get_rerun_state_machine()
        names = ("validate_result", "should_checkpoint_and_exit")
        if not all(callable(getattr(machine, name, None)) for name in names):
            self.monitor.warn("Megatron's rerun state machine has no validate_result or should_checkpoint_and_exit: "
                              "a step its nan check rejects may be lost when the run stops")
            return
        self.monitor.add_attachment(MethodWrap(machine, "validate_result", on_error=self._on_rejected),
                                    MethodWrap(machine, "should_checkpoint_and_exit", after=self._on_exit_decision))

    def _on_exit_decision(self, decision: tuple) -> tuple:
        """Megatron's re-run engine decided to stop (every rank learns it together): close the
        step now, merged as usual, and write it before train_step returns."""
        monitor = self.monitor
        if decision[1]:
            with monitor.guard("recording the step before Megatron exits"):
                monitor.step_end()
                monitor.active = False  # the caller's step_end for this iteration adds nothing
                monitor.drain()
                monitor.flush()
        return decision

    def _on_rejected(self, args: tuple, kwargs: dict) -> None:
        """Megatron's validation (e.g. `check_for_nan_in_loss_and_grad`) is about to raise:
        close the step and write it now, from this rank's own statistics (without the
        merge: the other ranks may never reach another collective)."""
        monitor = self.monitor
        result = kwargs.get("result", args[0] if args else None)
        reducer, monitor.reducer = monitor.reducer, None
        try:
            with monitor.guard("recording the step Megatron's check rejected"):
                if monitor.active:
                    if isinstance(result, torch.Tensor):
                        monitor.add_tensors([REJECTED], [result.detach()])
                    monitor.step_end()
                monitor.drain()
                monitor.flush()
        finally:
            monitor.reducer = reducer
