"""DeepSpeed MoE on CPU for tests/test_deepspeed_moe.py: a tiny model around one
`deepspeed.moe.layer.MoE` (4 experts, top-2), trained by a real DeepSpeed engine in a rank.

The MoE layer's input carries a constant feature (column 0 is 1.0), so a fault that adds to
one expert's gate weight on that feature sends every token to that expert (a collapse).
"""
from __future__ import annotations

from pathlib import Path

import torch

EXPERTS, TOP_K, DIM, VOCAB = 4, 2, 16, 32
BATCH, SEQ, GAS, STEPS, FAULT_STEP = 2, 8, 2, 6, 3
GATE = "moe.deepspeed_moe.gate"


class TinyMoE(torch.nn.Module):
    """Embedding, one DeepSpeed MoE layer (its l_aux added to the loss), a head."""

    def __init__(self, capacity_factor: float, drop_tokens: bool) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        expert = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM))
        self.moe = MoE(DIM, expert, num_experts=EXPERTS, ep_size=1, k=TOP_K, capacity_factor=capacity_factor,
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
    """Every case of CASES in this rank (a run of tests.multiproc.run_ranks)."""
    from examples.deepspeed_train import init_distributed

    init_distributed()
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
