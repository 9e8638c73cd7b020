"""DeepSpeed MoE on CPU for tests/test_deepspeed_moe.py: a tiny model around one
`deepspeed.moe.layer.MoE` (4 experts, top-2), trained by a real DeepSpeed engine in a rank;
`run_layouts` trains it on two ranks with expert parallelism 1 and 2.

The MoE layer's input carries a constant feature (column 0 is 1.0), so a fault that adds to
one expert's gate weight on that feature sends every token to that expert (a collapse).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

EXPERTS, TOP_K, DIM, VOCAB = 4, 2, 16, 32
BATCH, SEQ, GAS, STEPS, FAULT_STEP = 2, 8, 2, 6, 3
GATE = "moe.deepspeed_moe.gate"


class TinyMoE(torch.nn.Module):
    """Embedding, one DeepSpeed MoE layer (its l_aux added to the loss), a head."""

    def __init__(self, capacity_factor: float, drop_tokens: bool, ep_size: int = 1) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        expert = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM))
        self.moe = MoE(DIM, expert, num_experts=EXPERTS, ep_size=ep_size, k=TOP_K, capacity_factor=capacity_factor,
                       eval_capacity_factor=capacity_factor, min_capacity=1, drop_tokens=drop_tokens)
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.aux_losses: list[float] = []  # each micro-batch's l_aux, as DeepSpeed returned it

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = torch.cat([torch.ones_like(x[..., :1]), x[..., 1:]], dim=-1)
        y, l_aux, _ = self.moe(x)
        self.aux_losses.append(float(l_aux))
        logits = self.head(y)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + 0.01 * l_aux


#: name -> (capacity factor, drop tokens, collapse injected at FAULT_STEP)
CASES = {"capacity": (0.5, True, False), "no capacity": (1.0, False, False), "collapse": (1.0, False, True)}


def run_cases(rank: int, world: int, out: str) -> dict:
    """Every case of CASES in this rank."""
    return {name: run(Path(out) / name.replace(" ", "_"), rank, *case) for name, case in CASES.items()}


def run(out: Path, rank: int, capacity_factor: float, drop_tokens: bool, fault: bool) -> dict:
    """Train STEPS steps under DeepSpeedMonitor; the records' metrics and alerts, and the l_aux values."""
    import deepspeed

    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    torch.manual_seed(0)
    model = TinyMoE(capacity_factor, drop_tokens)
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": GAS,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=config)
    monitor = DeepSpeedMonitor(engine, {"output_dir": str(out), "strict": True, "sinks": ["jsonl"],
                                        "alerts": [{"rule": "expert_collapse"}, {"rule": "non_finite"}]})
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(STEPS):
        if fault and step == FAULT_STEP:
            with torch.no_grad():
                model.moe.deepspeed_moe.gate.wg.weight[1, 0] += 1e3  # every token's first choice: expert 1
        for _ in range(GAS):
            loss = engine(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
            engine.backward(loss)
            engine.step()
    monitor.close()
    return {"records": [(r.step, dict(r.metrics), [(a.rule, a.phase, a.tag) for a in r.alerts])
                        for r in monitor.history],
            "aux": model.aux_losses}


# ---- expert parallelism: EP=1 and EP=2 on two ranks, ZeRO-0 and ZeRO-2 ----------------------------------
EXPERTS_PATH = "moe.deepspeed_moe.experts.deepspeed_experts"
LAYOUT_STEPS = 3
LAYOUT_STATS = ("min", "max", "mean", "norm", "numel")
BF16 = "zero0-bf16-ep2"


def run_layouts(rank: int, world: int, out: str) -> dict:
    """Run in each of two ranks: the same model and data with ep_size 1 (every expert on both
    ranks) and ep_size 2 (experts 0-1 on rank 0, 2-3 on rank 1), under ZeRO-0 and ZeRO-2 (fp32),
    and ZeRO-0 bf16 with ep_size 2 (DeepSpeed's grad norm leaves the experts out there)."""
    runs = {f"zero{stage}-ep{ep}": run_layout(Path(out) / f"zero{stage}-ep{ep}", rank, stage, ep)
            for stage in (0, 2) for ep in (1, world)}
    runs[BF16] = run_layout(Path(out) / BF16, rank, 0, world, bf16=True)
    return runs


def run_all(rank: int, world: int, out: str) -> dict:
    """The whole launch (tests.multiproc.run_ranks, two ranks): `run_cases` and `run_layouts`."""
    from examples.deepspeed_train import init_distributed

    init_distributed()
    return {"cases": run_cases(rank, world, str(Path(out) / "cases")), "layouts": run_layouts(rank, world, out)}


def summary(tensor: torch.Tensor) -> dict[str, float]:
    """LAYOUT_STATS of a tensor, in float64 (the truth a monitored row is compared with)."""
    values = tensor.detach().double().reshape(-1)
    return {"min": values.min().item(), "max": values.max().item(), "mean": values.mean().item(),
            "norm": values.norm().item(), "numel": float(values.numel())}


def close(got: dict, want: dict, tag: str, rtol: float = 1e-6) -> bool:
    """Norms and counts within `rtol` of their value; min, max and mean within `rtol` of the
    tensor's largest magnitude (a mean of values of both signs is a difference of rounded numbers)."""
    base, _, stat = tag.rpartition("/")
    scale = max(abs(want[f"{base}/min"]), abs(want[f"{base}/max"])) if stat in ("min", "max", "mean") else 0.0
    return math.isclose(got[tag], want[tag], rel_tol=rtol, abs_tol=rtol * scale)


def _local_truth(model: TinyMoE, optimizer, grads: bool) -> dict[str, float]:
    """ZeRO-0: the statistics of this rank's experts' gradients (`grads`) or weights and exp_avg,
    under their global numbers (`ep_rank * num_local_experts + j`), in float64."""
    import torch.distributed as dist

    layer = model.moe.deepspeed_moe
    first = dist.get_rank(layer.ep_group) * layer.num_local_experts
    out = {}
    for j, expert in enumerate(layer.experts.deepspeed_experts):
        for tail, p in expert.named_parameters():
            name = f"{EXPERTS_PATH}.{first + j}.{tail}"
            pieces = {f"grad/{name}": p.grad} if grads else {f"param/{name}": p,
                                                              f"optim/{name}/exp_avg": optimizer.state[p]["exp_avg"]}
            out.update({f"{base}/{stat}": v for base, t in pieces.items() for stat, v in summary(t).items()})
    return out


def run_layout(out: Path, rank: int, stage: int, ep_size: int, bf16: bool = False) -> dict:
    """LAYOUT_STEPS steps under DeepSpeedMonitor: the records, DeepSpeed's own grad norms and, on
    ZeRO-0 fp32, the statistics of this rank's experts' tensors read at the monitor's points."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from msprobe_integrations.deepspeed import DeepSpeedMonitor
    from tests.ds_helpers import Warnings

    torch.manual_seed(0)
    model = TinyMoE(1.0, False, ep_size)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": GAS,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
              "bf16": {"enabled": bf16}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2), config=config)
    truths = stage == 0 and not bf16
    caught = Warnings()
    monitor = DeepSpeedMonitor(engine, {
        "output_dir": str(out), "strict": True, "sinks": ["jsonl"], "stats": list(LAYOUT_STATS),
        "watch": {"params": True, "optimizer_state": ["exp_avg", "exp_avg_sq"]},
        "alerts": [{"rule": "non_finite"}, {"rule": "misreported_grad_norm", "tolerance": 1e-5}]})
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    gen = torch.Generator().manual_seed(1 + rank)
    truth, norms, step_truth = [], [], {}
    for _ in range(LAYOUT_STEPS):
        for _ in range(GAS):
            loss = engine(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
            engine.backward(loss)
            if truths and engine.is_gradient_accumulation_boundary():
                step_truth = _local_truth(model, inner, grads=True)
            engine.step()
        truth.append({**step_truth, **(_local_truth(model, inner, grads=False) if truths else {})})
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    monitor.close()
    logging.getLogger("msprobe_engine").removeHandler(caught)
    return {"records": [(r.step, dict(r.metrics), [(a.rule, a.phase, a.tag) for a in r.alerts])
                        for r in monitor.history],
            "truth": truth, "ds_norms": norms, "warnings": caught.messages}
