"""DeepSpeed on CPU for tests/test_deepspeed.py: tiny engines, their training loop, and the references.

Every rank of a launch trains several engines one after the other (ZeRO stage x dtype);
each case returns plain data (metrics per step and the reference statistics read with
DeepSpeed's own full-tensor accessors at the same points) for the test process to check.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from examples.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
from msprobe_engine.stats import finalize, reference_partial
from tests.sink_helpers import EVERY_TAG_TENSORBOARD

MODEL = GPTConfig(vocab=64, dim=32, heads=2, layers=2, seq=16, batch=2)  # batch: one micro-batch of one rank
GAS = 2
STEPS = 3
LR = 1e-2
SUMMARY = ("min", "max", "mean", "norm", "numel")
WATCH = {"module_outputs": True, "param_grads": True, "params": True, "optimizer_state": ["exp_avg", "exp_avg_sq"]}
STATES = ("exp_avg", "exp_avg_sq")


#: DeepSpeed's own grad norm (`engine.get_global_grad_norm()`) checked against the merged one
MISREPORTED = {"rule": "misreported_grad_norm", "tolerance": 1e-5}
DEFAULT_RULES = [{"rule": "non_finite"}, {"rule": "spike"}]  # the config's default alerts


def monitor_config(out: str | Path, **overrides) -> dict:
    return {"strict": True, "output_dir": str(out), "stats": [*SUMMARY, "nan_count", "inf_count"],
            "sinks": [EVERY_TAG_TENSORBOARD, "jsonl"], "watch": WATCH, "alerts": [*DEFAULT_RULES, MISREPORTED],
            **overrides}


def ds_config(stage: int, dtype: str, **extra) -> dict:
    """fp32, bf16, bf16-fp32acc (bf16 with fp32 gradient accumulation: BF16_Optimizer) or fp16."""
    config = {"train_micro_batch_size_per_gpu": MODEL.batch, "gradient_accumulation_steps": GAS,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6,
              "gradient_clipping": 0.0}  # DeepSpeed clips at 1.0 by default; the plain reference does not
    if dtype.startswith("bf16"):
        config["bf16"] = {"enabled": True}
    if dtype == "bf16-fp32acc":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if dtype == "fp16":  # a loss scale far too high: the first steps overflow and are skipped
        config["fp16"] = {"enabled": True, "initial_scale_power": 17, "hysteresis": 1, "loss_scale_window": 100}
    return {**config, **extra}


def new_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(MODEL)


def global_batches(world: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch per optimizer step: every rank's micro-batches of that step together."""
    cfg = GPTConfig(**{**MODEL.__dict__, "batch": world * GAS * MODEL.batch})
    return list(synthetic_batches(cfg, steps, seed=3))


def micro_batch(batch: tuple[torch.Tensor, torch.Tensor], micro: int, rank: int, world: int):
    return tuple(t.chunk(world * GAS)[micro * world + rank] for t in batch)


def summary(tensor: torch.Tensor) -> dict[str, float]:
    """float64 numpy statistics of one whole tensor."""
    values = tensor.detach().float().cpu().numpy().astype(np.float64)
    stats = finalize(reference_partial(values))
    return {k: float(stats[k]) for k in SUMMARY}


def reference_metrics(world: int, out: Path, steps: int = STEPS) -> list[dict[str, float]]:
    """The same model trained without DeepSpeed (one process, each step's whole batch at once)."""
    from msprobe_integrations.torch import TorchMonitor

    model = new_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    monitor = TorchMonitor(model, optimizer, monitor_config(out, sinks=[]))
    for tokens, targets in global_batches(world, steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        monitor.step_end(loss)
    monitor.close()
    return [record.metrics for record in monitor.history]


def initial_gradient_norms(world: int, step: int) -> dict[str, float]:
    """fp32 gradient norms of the initial model on the whole batch of `step` (no DeepSpeed)."""
    model = new_model()
    model(*global_batches(world, step + 1)[step]).backward()
    return {n: float(p.grad.norm()) for n, p in model.named_parameters()}


class Warnings(logging.Handler):
    """Collects the monitor's warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("msprobe_engine").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# ---- in a rank ----------------------------------------------------------------------------------
def make_engine(stage: int, dtype: str, optimizer: Callable | None = torch.optim.AdamW, **extra):
    import deepspeed

    model = new_model()
    opt = optimizer(model.parameters(), lr=LR) if optimizer is not None else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, dtype, **extra))
    return engine


def train(engine, rank: int, world: int, steps: int = STEPS, at_boundary: Callable | None = None,
          after_step: Callable | None = None) -> None:
    """DeepSpeed's usual loop; the callbacks read the references at the monitor's reading points."""
    for batch in global_batches(world, steps):
        for micro in range(GAS):
            loss = engine(*micro_batch(batch, micro, rank, world))
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary() and at_boundary is not None:
                at_boundary()
            engine.step()
        if after_step is not None:
            after_step()


def full_grads(engine) -> dict[str, dict]:
    """Gradients from DeepSpeed's collective full-tensor accessor (ZeRO-0: `param.grad`)."""
    from deepspeed.utils import safe_get_full_grad
    return {n: summary(safe_get_full_grad(p)) for n, p in engine.module.named_parameters()}


def full_state(engine) -> dict[str, dict]:
    """fp32 parameters and optimizer state: `safe_get_full_*` for ZeRO 1-3, the optimizer's
    `state_dict()` for ZeRO-0 (its states are in parameter order)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    named = list(engine.module.named_parameters())
    out: dict[str, dict] = {}
    if engine.zero_optimization_stage() > 0:
        for n, p in named:
            out[f"param/{n}"] = summary(safe_get_full_fp32_param(p))
            for key in STATES:
                out[f"optim/{n}/{key}"] = summary(safe_get_full_optimizer_state(p, key))
        return out
    saved = engine.optimizer.state_dict()
    inner = saved.get("optimizer_state_dict", saved)
    if "fp32_groups" in saved:  # FP16_UnfusedOptimizer (bf16/fp16)
        masters = [t for group in saved["fp32_groups"] for t in group]
    else:
        masters = [p for _, p in named]
    for i, (n, _) in enumerate(named):
        out[f"param/{n}"] = summary(masters[i])
        for key in STATES:
            out[f"optim/{n}/{key}"] = summary(inner["state"][i][key])
    return out


def run_case(out: Path, rank: int, world: int, stage: int, dtype: str, config: dict | None = None,
             engine_monitor: bool = False, patch: Callable | None = None, **extra) -> dict:
    """Train one engine with the monitor; return its records and the references (`patch`, when
    given, changes the engine first)."""
    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    engine = make_engine(stage, dtype, **extra)
    if patch is not None:
        patch(engine)
    monitor = DeepSpeedMonitor(engine, config=config or monitor_config(out), engine_monitor=engine_monitor)
    grads, states, scales, norms = [], [], [], []

    def after_step() -> None:
        states.append(full_state(engine) if engine.was_step_applied() else None)
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))

    def at_boundary() -> None:
        # fp16 gradients are checked against fp32 ones instead (tests/test_deepspeed.py)
        scales.append(float(engine.optimizer.loss_scale) if dtype == "fp16" else 1.0)
        grads.append(None if dtype == "fp16" else full_grads(engine))

    train(engine, rank, world, steps=5 if dtype == "fp16" else STEPS, at_boundary=at_boundary,
          after_step=after_step)
    monitor.close()
    restored = "step" not in engine.__dict__ and "backward" not in engine.__dict__
    return {"records": [{"step": r.step, "micro_steps": r.micro_steps, "metrics": r.metrics,
                         "alerts": [a.as_dict() for a in r.alerts]} for r in monitor.history],
            "grads": grads, "states": states, "scales": scales, "ds_norms": norms, "transfers": monitor.transfers,
            "decides_early": monitor.decide_early, "incidents": _incidents(out, rank),
            "optimizer": type(engine.optimizer).__name__, "restored": restored}


# ---- one launch: every case, one engine after the other ---------------------------------------------
CASES = [(stage, dtype) for dtype in ("fp32", "bf16") for stage in (0, 1, 2, 3)]


def run_launch(rank: int, world: int, out: str) -> dict:
    """Run in each rank by `tests.multiproc.run_ranks`: every case of CASES, then the extras."""
    from examples.deepspeed_train import init_distributed

    init_distributed()
    root = Path(out)
    results = {f"zero{s}-{d}": run_case(root / f"zero{s}-{d}", rank, world, s, d) for s, d in CASES}
    if world == 1:
        for stage, dtype in ACTION_CASES:
            results[f"skip-zero{stage}-{dtype}"] = action_case(root / f"skip-zero{stage}-{dtype}", rank, world,
                                                               stage, dtype)
        results["stop-zero0"] = stop_case(root / "stop-zero0", rank, world, 0)
        results["bad input"] = bad_input(root / "bad")
        enable_fp16_on_cpu()
        results["zero0-fp16"] = run_case(root / "zero0-fp16", rank, world, 0, "fp16")
        results["zero3-fp16"] = run_case(root / "zero3-fp16", rank, world, 3, "fp16", config=fp16_stop_config(
            root / "zero3-fp16"))
        return results
    results["zero1-bf16-fp32acc"] = run_case(root / "zero1-bf16-fp32acc", rank, world, 1, "bf16-fp32acc")
    per_rank = root / "per-rank"
    results["per-rank"] = run_case(
        per_rank, rank, world, 1, "fp32", config=monitor_config(per_rank, per_rank=True), engine_monitor=True,
        tensorboard={"enabled": True, "job_name": "ds", "output_path": str(per_rank / "deepspeed")})
    results["different modules"] = different_modules(root / "different-modules", rank, world)
    results["local-norm"] = run_case(root / "local-norm", rank, world, 2, "fp32",
                                     patch=local_partition_norm(rank, world))
    results["skip-zero2-fp32"] = action_case(root / "skip-zero2-fp32", rank, world, 2, "fp32")
    results["stop-zero2-per-rank"] = stop_case(root / "stop-zero2-per-rank", rank, world, 2, per_rank=True)
    enable_fp16_on_cpu()
    results["zero2-fp16"] = run_case(root / "zero2-fp16", rank, world, 2, "fp16",
                                     config=fp16_stop_config(root / "zero2-fp16"))
    return results


#: world 1: the skip action on every ZeRO stage (fp32) and on one bf16 stage
ACTION_CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16")]


def fp16_stop_config(out: Path) -> dict:
    """fp16 under a stop rule on every loss-scaled kind: routine overflows must not fire it."""
    return monitor_config(out, watch={**WATCH, "activation_grads": True},
                          alerts=[{"rule": "non_finite", "targets": ["loss", "actv", "actv_grad", "grad"],
                                   "action": "stop"}, MISREPORTED])


def local_partition_norm(rank: int, world: int) -> Callable:
    """The local-shard bug inside DeepSpeed's own norm: ZeRO-1/2's `get_grad_norm_direct`
    reduces the squared norms of this rank's gradient partition over a group of this rank
    alone instead of the data-parallel group, so `engine.get_global_grad_norm()` is the norm of
    the partition (the gradients themselves, and their reduction, are untouched)."""
    import torch.distributed as dist

    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group

    def patch(engine) -> None:
        optimizer = engine.optimizer
        original = optimizer.get_grad_norm_direct

        def partition_norm(*args, **kwargs):
            group, optimizer.dp_process_group = optimizer.dp_process_group, alone
            try:
                return original(*args, **kwargs)
            finally:
                optimizer.dp_process_group = group

        optimizer.get_grad_norm_direct = partition_norm

    return patch


def enable_fp16_on_cpu() -> None:
    """DeepSpeed refuses fp16 on a CPU without fp16 kernels; torch computes it anyway (slowly).
    Only this capability check is lifted: loss scaling and overflow skipping run for real."""
    from deepspeed.accelerator import get_accelerator
    get_accelerator().is_fp16_supported = lambda: True


def bad_input(out: Path) -> dict[str, str]:
    """Engines the integration can only partly monitor: what it says about them."""
    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    said = {}
    caught = Warnings()
    engine = make_engine(0, "fp32", optimizer=None)
    DeepSpeedMonitor(engine, config=monitor_config(out / "none")).close()
    said["no optimizer"] = "\n".join(caught.messages)
    caught.messages.clear()
    engine = make_engine(0, "fp32", optimizer=torch.optim.SGD)
    monitor = DeepSpeedMonitor(engine, config=monitor_config(out / "sgd"), engine_monitor=True)
    train(engine, 0, 1, steps=1)
    monitor.close()
    said["sgd"] = "\n".join(caught.messages)
    return said


def different_modules(out: Path, rank: int, world: int) -> str:
    """Each rank watches another module (as many rows, other keys): the merge must refuse."""
    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    engine = make_engine(0, "fp32")
    monitor = DeepSpeedMonitor(engine, config=monitor_config(out, modules={"names": [f"layers.{rank}.mlp"]}))
    try:
        train(engine, rank, world, steps=1)
    except RuntimeError as exc:
        return str(exc)
    finally:
        monitor.close()
    return "merged without complaint"


# ---- actions: skip and stop, incidents --------------------------------------------------------------
ACTION_STEPS = 5
SPIKE_AT, NAN_AT = 1, 3  # steps 0, 2 and 4 are normal
STOP_AT = 1
CULPRIT = "layers.1.mlp.0"
WARMUP_LR = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": LR / 2, "warmup_max_lr": LR,
                                                             "warmup_type": "linear",
                                                             "warmup_num_steps": 100}}}
SNAPSHOT = ("weights", "masters", "exp_avg", "exp_avg_sq", "step", "lr")


def action_config(out: Path, action: str = "skip", targets=("loss", "actv", "grad"), **overrides) -> dict:
    """A x1000 spike of CULPRIT's output fires the spike rule (gradients stay finite, so only our
    skip keeps DeepSpeed from applying the step); a nan fires non_finite."""
    rules = [{"rule": "spike", "metrics": [f"actv/{CULPRIT}/output/norm"], "factor": 3.0, "warmup": 1,
              "action": "skip"},
             {"rule": "non_finite", "targets": list(targets), "action": action}, MISREPORTED]
    return monitor_config(out, alerts=rules, **overrides)


def inject_at(engine, rank: int, faults: dict[int, str], ranks=None):
    """CULPRIT's output turns bad at the given steps ({step: 'spike' | 'nan'}), on `ranks` (all)."""
    module = engine.module.get_submodule(CULPRIT)

    def corrupt(mod, args, output):
        kind = faults.get(engine.global_steps)
        if kind is None or (ranks is not None and rank not in ranks):
            return None
        if kind == "spike":
            return output * 1000.0
        bad = output.clone()
        bad.view(-1)[0] = float("nan")
        return bad

    return module.register_forward_hook(corrupt)  # before the monitor's hooks: they see the bad output


def snapshot(engine) -> dict[str, list[torch.Tensor]]:
    """Copies of everything an optimizer step changes: model weights (this rank's ZeRO-3 partition),
    full fp32 masters and Adam moments, the torch optimizer's step counts, the lr and the schedule."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    named = list(engine.module.named_parameters())
    stage = engine.zero_optimization_stage()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    out = {"weights": [(p.ds_tensor if stage == 3 else p).detach().clone() for _, p in named]}
    if stage > 0:
        out["masters"] = [safe_get_full_fp32_param(p).clone() for _, p in named]
        for key in STATES:
            out[key] = [safe_get_full_optimizer_state(p, key).clone() for _, p in named]
    else:
        masters = getattr(engine.optimizer, "fp32_groups", None)
        masters = [t for g in masters for t in g] if masters is not None else [p for _, p in named]
        out["masters"] = [m.detach().clone() for m in masters]
        for key in STATES:
            out[key] = [inner.state[m][key].clone() for m in masters]
    out["step"] = [torch.as_tensor(s["step"], dtype=torch.float64).clone() for s in inner.state.values()]
    out["lr"] = [torch.tensor([g["lr"] for g in inner.param_groups], dtype=torch.float64),
                 torch.tensor([float(engine.lr_scheduler.last_batch_iteration)])]
    return out


def changes(before: dict, after: dict) -> dict[str, bool]:
    """Which parts of the snapshot changed (bitwise), and whether all of it is finite."""
    out = {k: not all(torch.equal(a, b) for a, b in zip(before[k], after[k], strict=True)) for k in SNAPSHOT}
    out["finite"] = all(bool(torch.isfinite(t.float()).all()) for k in SNAPSHOT for t in after[k])
    return out


def action_case(out: Path, rank: int, world: int, stage: int, dtype: str) -> dict:
    """Steps 0-4 with a spike at SPIKE_AT and a nan at NAN_AT (rank 0 only), both skipped: what
    each step changed, the records and the incidents written."""
    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    engine = make_engine(stage, dtype, **WARMUP_LR)
    handle = inject_at(engine, rank, {SPIKE_AT: "spike", NAN_AT: "nan"}, ranks=[0])
    monitor = DeepSpeedMonitor(engine, config=action_config(out))
    snapshots = []
    train(engine, rank, world, steps=ACTION_STEPS, after_step=lambda: snapshots.append(snapshot(engine)))
    monitor.close()
    handle.remove()
    return {"changes": [changes(a, b) for a, b in zip(snapshots, snapshots[1:])],
            "records": _records(monitor), "incidents": _incidents(out, rank)}


def stop_case(out: Path, rank: int, world: int, stage: int, per_rank: bool = False) -> dict:
    """A nan at STOP_AT on rank 0 only with a `stop` rule on activations: TrainingStopped out of
    engine.step() on every rank (per_rank: rank 1's own activations are clean), the weights as
    before the step; what is on disk when it is caught, before monitor.close()."""
    from msprobe_engine.incident import TrainingStopped
    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    engine = make_engine(stage, "fp32", **WARMUP_LR)
    handle = inject_at(engine, rank, {STOP_AT: "nan"}, ranks=[0])
    monitor = DeepSpeedMonitor(engine, config=action_config(out, "stop", targets=["actv"], per_rank=per_rank))
    snapshots = []
    stopped = None
    try:
        train(engine, rank, world, steps=ACTION_STEPS, after_step=lambda: snapshots.append(snapshot(engine)))
    except TrainingStopped as exc:
        stopped = {"step": exc.step, "rules": exc.rules, "incidents": [str(d) for d in exc.incidents]}
    unchanged = not any(changes(snapshots[-1], snapshot(engine))[k] for k in SNAPSHOT)
    jsonl = out / f"rank{rank}" / "metrics.jsonl"
    on_disk = [json.loads(line)["step"] for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    incidents = _incidents(out, rank)
    monitor.close()
    handle.remove()
    return {"stopped": stopped, "unchanged": unchanged, "steps_done": len(snapshots), "on_disk": on_disk,
            "incidents": incidents}


def _records(monitor) -> list[dict]:
    return [{"step": r.step, "metrics": r.metrics, "alerts": [a.as_dict() for a in r.alerts]}
            for r in monitor.history]


def _incidents(out: Path, rank: int) -> dict[str, dict]:
    """incident directory name -> incident.json, this rank's."""
    root = out / "incidents"
    return {d.name: json.loads((d / "incident.json").read_text())
            for d in sorted(root.glob(f"*-rank{rank}-*")) if (d / "incident.json").is_file()}
