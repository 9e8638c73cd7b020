"""Megatron-core (0.16.1 on Python 3.11, 0.19.2 on 3.12) on a CPU: the test-only patches, a tiny GPTModel and a training step.

Shared by tests/test_megatron.py, examples/megatron_train.py and
bench/megatron_overhead.py. The patches (see shared/notes/frameworks-on-cpu.md)
only make CUDA-only allocations land on the CPU; none of them is needed on GPUs:
1. the tensor-parallel RNG tracker is created directly (`model_parallel_cuda_manual_seed`
   needs CUDA);
2. `GlobalMemoryBuffer.get_tensor` allocates on the CPU;
3. `torch.cuda.current_device()` answers "cpu", `torch.cuda.synchronize` does nothing
   (Megatron's DDP), `torch.cuda.current_stream()` is a stream that waits for nothing
   (megatron-core 0.19's grad sync) and the CUDA RNG state is the CPU's (the re-run engine
   saves it);
4. `torch.tensor/zeros/ones/empty(..., device="cuda")` allocate on the CPU (Megatron's
   optimizers, grad norm and re-run engine);
5. while a Megatron optimizer is built, CPU tensors report CUDA type names (its
   constructors check them);
6. megatron-core 0.16.1 without Transformer Engine leaves `moe_utils.te_general_gemm`
   undefined (the MoE router's gating raises NameError); it is set to None, as 0.19 does.
7. grouped-GEMM experts (megatron-core 0.16's `GroupedMLP`) call `grouped_gemm.ops.gmm`, a CUDA
   kernel package: `grouped_gemm_util` gets a plain-torch `gmm` (one matmul per expert's rows);
   `GroupedMLP.forward` asserts `config.bf16` (the kernel's only dtype), so each GroupedMLP gets
   a copy of the config saying bf16 while the model stays float32.
8. `TorchFullyShardedDataParallel` builds its device mesh with `DeviceMesh.from_group(group,
   "cuda")`: while it is built, the mesh is made on the CPU (`wrap_torch_fsdp`).
MoE models use the `allgather` token dispatcher (`alltoall` creates CUDA streams).
`train_step` is the shape of Megatron-LM's: forward and backward over the
micro-batches (pipeline stages exchange activations with send/recv, one
micro-batch at a time) and `finalize_model_grads`, under the re-run engine's
`should_run_forward_backward` loop, then `should_checkpoint_and_exit()` and
`optimizer.step()`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import DeviceMesh
from megatron.core import parallel_state, tensor_parallel
from megatron.core import utils as megatron_utils
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       TorchFullyShardedDataParallel, finalize_model_grads,
                                       torch_fully_sharded_data_parallel)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer
from megatron.core.rerun_state_machine import (RerunMode, destroy_rerun_state_machine, get_rerun_state_machine,
                                                initialize_rerun_state_machine)
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.multiproc import free_port


@dataclass(frozen=True)
class TinySpec:
    """The tiny GPT and its data."""
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 128
    seq: int = 16
    batch: int = 2
    experts: int = 0  # > 0: every MLP a mixture of this many experts (top-2 routing)
    capacity: float | None = None  # MoE: Megatron's moe_expert_capacity_factor (None: no capacity)
    grouped: bool = False  # MoE: grouped-GEMM experts (GroupedMLP, megatron-core 0.16; patch 7)
    aux_loss: float = 0.0  # MoE: > 0, the coefficient of Megatron's load-balancing loss ("aux_loss")
    #: False: no self-attention in the layers (Megatron's `IdentityOp` in its place), the one way
    #: to run context parallelism without Transformer Engine (see `attention_free`)
    attention: bool = True


def patch_for_cpu() -> None:
    """Patches 2, 3 and 4 (process-wide, idempotent)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _CPU_STREAM
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *args, **kwargs: None
    megatron_utils.GlobalMemoryBuffer.get_tensor = _cpu_buffer_tensor
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    for name in ("tensor", "zeros", "ones", "empty"):
        factory = getattr(torch, name)
        if not getattr(factory, "cuda_on_cpu", False):
            setattr(torch, name, _on_cpu(factory))


class _NoWaitStream:
    """What `torch.cuda.current_stream()` answers on a CPU: CPU work is already in order."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


_CPU_STREAM = _NoWaitStream()


def _on_cpu(factory: Callable) -> Callable:
    def allocate(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    allocate.cuda_on_cpu = True
    return allocate


def _cpu_buffer_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
    return torch.empty(tensor_shape, dtype=dtype)


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1234,
                  rerun_mode: RerunMode = RerunMode.DISABLED, ep: int = 1, cp: int = 1) -> None:
    """gloo process group (from the RANK/WORLD_SIZE/MASTER_* environment), Megatron's groups
    and its re-run engine."""
    patch_for_cpu()
    if not dist.is_initialized():
        # a free port, not a fixed one: pytest-xdist runs several one-rank worlds at once
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                           ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        dist.init_process_group("gloo")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, context_parallel_size=cp)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # patch 1
    torch.manual_seed(seed)
    fresh_rerun_engine(rerun_mode)


def fresh_rerun_engine(mode: RerunMode = RerunMode.DISABLED) -> None:
    """Megatron's re-run engine, as Megatron-LM sets it up at start (before the monitor wraps it)."""
    destroy_rerun_state_machine()
    initialize_rerun_state_machine(mode=mode)


def build_gpt(spec: TinySpec = TinySpec(), seed: int = 1234) -> GPTModel:
    """The tiny GPT for this rank's pipeline stage, with the same weights for every TP/PP split."""
    config = TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        persist_layer_norm=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        **_moe(spec))
    if spec.grouped:
        _plain_grouped_gemm()
    layer_spec = get_gpt_layer_local_spec(**({"num_experts": spec.experts, "moe_grouped_gemm": spec.grouped}
                                              if spec.experts else {}))
    if not spec.attention:
        layer_spec = attention_free(layer_spec)
    model = GPTModel(config, layer_spec, vocab_size=spec.vocab, max_sequence_length=spec.seq,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    if spec.grouped:
        _grouped_on_cpu(model)
    _init_by_global_name(model, seed)
    return model


def attention_free(layer_spec: ModuleSpec) -> ModuleSpec:
    """The layer spec without self-attention (its norm, attention and residual add Megatron's
    placeholders): Megatron's only core attention without Transformer Engine, `DotProductAttention`,
    asserts `context_parallel_size == 1`; every other module of the layer works token by token,
    so context parallelism runs."""
    submodules = dataclasses.replace(layer_spec.submodules, input_layernorm=IdentityOp,
                                     self_attention=IdentityOp, self_attn_bda=IdentityFuncOp)
    return dataclasses.replace(layer_spec, submodules=submodules)


def cp_slice(tensor: torch.Tensor) -> torch.Tensor:
    """This context-parallel rank's part of a [batch, sequence] tensor, cut as Megatron-LM's
    `get_batch_on_this_cp_rank` does: 2 x CP chunks, rank r taking chunks r and 2 x CP - 1 - r."""
    cp, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    if cp == 1:
        return tensor
    chunks = tensor.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)


def _moe(spec: TinySpec) -> dict:
    """The TransformerConfig keys of an MoE model: top-2 routing, by default without load-balancing
    loss (its value depends on how tokens are split into micro-batches) and without capacity, the
    allgather dispatcher."""
    if not spec.experts:
        return {}
    balancing = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": spec.aux_loss} \
        if spec.aux_loss else {"moe_router_load_balancing_type": "none"}
    return {"num_moe_experts": spec.experts, "moe_router_topk": 2, **balancing,
            "moe_expert_capacity_factor": spec.capacity,
            "moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": spec.grouped, "add_bias_linear": False,
            "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size()}


def _plain_gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """`grouped_gemm.ops.gmm` in plain torch: the rows of expert e (`batch_sizes[e]` of them, in
    order) times `b[e]` (transposed with `trans_b`)."""
    parts = a.split(batch_sizes.tolist())
    return torch.cat([x @ (w.t() if trans_b else w) for x, w in zip(parts, b)])


class _PlainGroupedGemm:
    """What megatron-core reads of the `grouped_gemm` package: `ops.gmm` (patch 7)."""

    class ops:
        gmm = staticmethod(_plain_gmm)


def _plain_grouped_gemm() -> None:
    """Patch 7, first half: the plain-torch `gmm` (before a GroupedMLP is built: it checks)."""
    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.grouped_gemm, grouped_gemm_util.ops = _PlainGroupedGemm, _PlainGroupedGemm.ops


def _grouped_on_cpu(model: GPTModel) -> None:
    """Patch 7, second half: each GroupedMLP's config saying bf16."""
    from megatron.core.transformer.moe import experts

    for module in model.modules():
        if isinstance(module, experts.GroupedMLP):
            module.config = dataclasses.replace(module.config, bf16=True)


def _init_by_global_name(model: GPTModel, seed: int) -> None:
    """Every weight drawn from a generator seeded by its global name (whatever stage, or
    expert-parallel rank, holds it), then cut to this rank's tensor-parallel part as Megatron's
    CPU initialisation does."""
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    offsets = {}
    for i, layer in enumerate(model.decoder.layers):
        offsets[f"decoder.layers.{i}."] = f"decoder.layers.{layer.layer_number - 1}."
        for j, expert in enumerate(getattr(layer.mlp, "local_expert_indices", [])):
            offsets[f"decoder.layers.{i}.mlp.experts.local_experts.{j}."] = \
                f"decoder.layers.{layer.layer_number - 1}.mlp.experts.local_experts.{expert}."
    pieces = {}  # a GroupedMLP weight -> its per-expert view and the global name of each local expert's piece
    for layer in model.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if hasattr(experts, "weight1"):
            head, count = f"decoder.layers.{layer.layer_number - 1}.mlp.experts.local_experts.", len(layer.mlp.local_expert_indices)
            for attr, tail, view in (("weight1", "linear_fc1.weight", (count, model.config.hidden_size, -1)),
                                     ("weight2", "linear_fc2.weight", (count, -1, model.config.hidden_size))):
                pieces[id(getattr(experts, attr))] = (view, [f"{head}{e}.{tail}" for e in layer.mlp.local_expert_indices])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if id(param) in pieces:  # expert j's piece: the weight its SequentialMLP expert would draw, transposed
                view, names = pieces[id(param)]
                for piece, expert_name in zip(param.view(view), names):
                    gen = torch.Generator().manual_seed(seed + zlib.crc32(expert_name.encode()))
                    piece.copy_(torch.randn(piece.shape[::-1], generator=gen).t() * 0.02)
                continue
            local = max((k for k in offsets if name.startswith(k)), key=len, default=None)
            name = offsets[local] + name[len(local):] if local else name
            shape = list(param.shape)
            partitioned = getattr(param, "tensor_model_parallel", False) and tp > 1
            if partitioned:
                shape[param.partition_dim] *= tp
            gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
            full = torch.randn(shape, generator=gen) * 0.02 + (1.0 if "layernorm.weight" in name else 0.0)
            param.copy_(full.chunk(tp, dim=param.partition_dim)[rank] if partitioned else full)


def wrap_ddp(model: GPTModel, distributed_optimizer: bool = False,
             check_for_nan_in_grad: bool = False) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               check_for_nan_in_grad=check_for_nan_in_grad)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def wrap_torch_fsdp(model: GPTModel) -> TorchFullyShardedDataParallel:
    """Megatron's torch-FSDP2 wrapper over the data-parallel group, as Megatron-LM's
    `--use-torch-fsdp2 --transformer-impl local` builds it (patch 8 while it is built)."""
    model.config.transformer_impl = "local"  # the local layer spec: the output layer is not wrapped apart
    module = torch_fully_sharded_data_parallel
    mesh_type = module.DeviceMesh
    module.DeviceMesh = _CpuDeviceMesh
    try:
        fsdp = TorchFullyShardedDataParallel(model.config, DistributedDataParallelConfig(), model)
    finally:
        module.DeviceMesh = mesh_type
    model.config.finalize_model_grads_func = finalize_model_grads
    return fsdp


def torch_fsdp_trains() -> bool:
    """Whether Megatron's own `finalize_model_grads` can run on a `TorchFullyShardedDataParallel`:
    megatron-core 0.16.1's passes `finish_grad_sync(force_all_reduce=...)`, which its
    TorchFullyShardedDataParallel does not take (a TypeError, on any device); 0.19 takes it."""
    return "force_all_reduce" in inspect.signature(TorchFullyShardedDataParallel.finish_grad_sync).parameters


class _CpuDeviceMesh:
    """Patch 8: what `TorchFullyShardedDataParallel` reads of `DeviceMesh`, on the CPU."""

    @staticmethod
    def from_group(group, device_type: str, *args, **kwargs):
        return DeviceMesh.from_group(group, "cpu", *args, **kwargs)


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """Patch 5, only while a Megatron optimizer is constructed."""
    tensor_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = tensor_type(self, *args, **kwargs)
        if args or kwargs or not name.startswith("torch.") or name.startswith("torch.cuda."):
            return name
        return "torch.cuda." + name[len("torch."):]

    torch.Tensor.type = cuda_type
    try:
        yield
    finally:
        torch.Tensor.type = tensor_type


def build_optimizer(chunks: list[DistributedDataParallel], lr: float = 1e-3) -> ChainedOptimizer:
    """What `get_megatron_optimizer` returns for Adam without clipping: a ChainedOptimizer of a
    DistributedOptimizer (when the DDP config asks for it) or an FP32Optimizer."""
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    inner = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    distributed = chunks[0].ddp_config.use_distributed_optimizer
    config = OptimizerConfig(optimizer="adam", lr=lr, clip_grad=0.0, use_distributed_optimizer=distributed)
    with cuda_type_names():
        if distributed:
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            optimizer = DistributedOptimizer(
                inner, config, None, None, chunks, {i: c.buffers for i, c in enumerate(chunks)},
                group, None, 0, 0)
        else:
            optimizer = FP32Optimizer(inner, config, None)
    return ChainedOptimizer([optimizer])


def micro_batches(spec: TinySpec, count: int, seed: int) -> list[torch.Tensor]:
    """Deterministic token batches with a learnable pattern (next token = token + 1)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, spec.vocab, (count, spec.batch, 1), generator=gen)
    return list((starts + torch.arange(spec.seq)) % spec.vocab)


def inject_nan(model: DistributedDataParallel, layer: int) -> None:
    """Put a nan into the first MLP weight of global layer `layer` (0-based), if this stage holds it."""
    for block in model.module.decoder.layers:
        if block.layer_number == layer + 1:
            with torch.no_grad():
                block.mlp.linear_fc1.weight.view(-1)[0] = float("nan")


def loss_check(loss: torch.Tensor) -> None:
    """Megatron-LM's `check_for_nan_in_loss_and_grad` on the loss (as pretrain_gpt's loss_func)."""
    get_rerun_state_machine().validate_result(
        result=loss, rejection_func=torch.isnan, message="found NaN in local forward loss calculation",
        tolerance=0.0, fatal=True)


def train_step(model: DistributedDataParallel, optimizer: ChainedOptimizer, batches: list[torch.Tensor],
               check_nan: bool = False, after_backward: Callable[[], None] | None = None
               ) -> tuple[torch.Tensor | None, float | None, bool]:
    """One optimizer step over `batches` (micro-batches). Returns the mean loss on the last
    pipeline stage (None elsewhere), Megatron's gradient norm, and whether Megatron's re-run
    engine asks to exit (then no optimizer step was taken). `after_backward` runs once the
    gradients are final."""
    machine = get_rerun_state_machine()
    while machine.should_run_forward_backward(None):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = [loss for tokens in batches
                  if (loss := _forward_backward(model, tokens, len(batches), check_nan)) is not None]
        model.config.finalize_model_grads_func([model])
    _, should_exit, _ = machine.should_checkpoint_and_exit()
    if should_exit:
        return None, None, True
    if after_backward is not None:
        after_backward()
    _, grad_norm, _ = optimizer.step()
    return (torch.stack(losses).mean() if losses else None), grad_norm, False


def _forward_backward(model: DistributedDataParallel, tokens: torch.Tensor, count: int,
                      check_nan: bool) -> torch.Tensor | None:
    position_ids = cp_slice(torch.arange(tokens.shape[1]).expand_as(tokens))
    labels = cp_slice((tokens + 1) % model.module.vocab_size)
    tokens = cp_slice(tokens)
    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    received = None
    if not first:
        hidden = model.module.config.hidden_size
        received = torch.empty(seq, tokens.shape[0], hidden)
        dist.recv(received, parallel_state.get_pipeline_model_parallel_prev_rank())
        received.requires_grad_(True)
        model.module.set_input_tensor(received)
    output = model(tokens, position_ids, mask, labels=labels if last else None)
    loss = None
    if last:
        loss = output.float().mean()
        if check_nan:
            loss_check(loss)
        (loss / count).backward()
    else:
        dist.send(output.detach(), parallel_state.get_pipeline_model_parallel_next_rank())
        grad = torch.empty_like(output)
        dist.recv(grad, parallel_state.get_pipeline_model_parallel_next_rank())
        output.backward(grad)
    if received is not None:
        dist.send(received.grad, parallel_state.get_pipeline_model_parallel_prev_rank())
    return None if loss is None else loss.detach()
