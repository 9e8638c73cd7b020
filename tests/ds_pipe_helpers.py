"""DeepSpeed's PipelineEngine on CPU for tests/test_deepspeed_pipeline.py: a four-layer
`PipelineModule` (LayerSpecs) in two stages (layers 0-1, 2-3) trained by `engine.train_batch` in
each of two ranks under DeepSpeedMonitor, and the truth: the same model (the same initial weights,
data and AdamW) trained unpipelined in the rank, with each layer's output, output gradient,
parameter gradient, weight and Adam moments measured in float64 at the monitor's points."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.ds_moe_helpers import LAYOUT_STATS as STATS
from tests.ds_moe_helpers import summary

DIM, OUT, BATCH, GAS, STEPS = 8, 4, 4, 2, 2
LR = 1e-2


def _layers() -> list:
    """(class, args) of each layer, for LayerSpecs and for the reference."""
    return [(torch.nn.Linear, (DIM, 2 * DIM)), (torch.nn.Tanh, ()), (torch.nn.Linear, (2 * DIM, 2 * DIM)),
            (torch.nn.Linear, (2 * DIM, OUT))]


def _batches(dp: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each micro-batch of the run: one (input, target) per data-parallel rank."""
    gen = torch.Generator().manual_seed(1)
    return [[(torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, OUT, generator=gen)) for _ in range(dp)]
            for _ in range(STEPS * GAS)]


def _stats(base: str, tensor: torch.Tensor) -> dict[str, float]:
    return {f"{base}/{stat}": value for stat, value in summary(tensor).items()}


def truth(reference: torch.nn.Sequential, dp: int) -> list[dict[str, float]]:
    """Each step's statistics of the unpipelined run (every data-parallel rank's micro-batches in
    one), by the monitor's tags."""
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    data = iter([tuple(torch.cat(t) for t in zip(*micro)) for micro in _batches(dp)])
    out = []
    for _ in range(STEPS):
        outputs: dict[str, list] = {}
        grads: dict[str, list] = {}

        def keep(name):
            def hook(module, args, output):
                outputs.setdefault(name, []).append(output.detach())
                output.register_hook(lambda g: grads.setdefault(name, []).append(g.detach()))
            return hook

        handles = [m.register_forward_hook(keep(n)) for n, m in reference.named_children()]
        for _ in range(GAS):
            x, y = next(data)
            (torch.nn.functional.mse_loss(reference(x), y) / GAS).backward()
        for h in handles:
            h.remove()
        step = {}
        for name in outputs:
            step |= _stats(f"actv/{name}/output", torch.cat(outputs[name]))
            # each data-parallel rank's of its own mean loss: dp times the whole batch's
            step |= _stats(f"actv_grad/{name}/output", torch.cat(grads[name]) * dp)
        step |= {k: v for n, p in reference.named_parameters() for k, v in _stats(f"grad/{n}", p.grad).items()}
        optimizer.step()
        optimizer.zero_grad()
        for n, p in reference.named_parameters():
            step |= _stats(f"param/{n}", p)
            step |= _stats(f"optim/{n}/exp_avg", optimizer.state[p]["exp_avg"])
            step |= _stats(f"optim/{n}/exp_avg_sq", optimizer.state[p]["exp_avg_sq"])
        out.append(step)
    return out


def run_all(rank: int, world: int, out: str, stages: int = 2) -> dict[int, dict]:
    """The whole launch (tests.multiproc.run_ranks): `run` on ZeRO-0 and ZeRO-1, one after the other."""
    from examples.deepspeed_train import init_distributed

    init_distributed()
    return {zero: run(rank, world, str(Path(out) / f"zero{zero}"), stages, zero) for zero in (0, 1)}


def run(rank: int, world: int, out: str, stages: int = 2, zero: int = 0) -> dict:
    """Train STEPS `train_batch`es of GAS micro-batches on `stages` pipeline stages (x world / stages
    data-parallel ranks, ZeRO stage `zero`) under DeepSpeedMonitor; this rank's records, its layers'
    names, and the truth (rank 0)."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from msprobe_integrations.deepspeed import DeepSpeedMonitor

    torch.manual_seed(0)
    reference = torch.nn.Sequential(*(cls(*args) for cls, args in _layers()))
    model = PipelineModule([LayerSpec(cls, *args) for cls, args in _layers()], num_stages=stages,
                           loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    model.load_state_dict({k: v for k, v in reference.state_dict().items() if k in model.state_dict()})
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": GAS,
              "zero_optimization": {"stage": zero}, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=config)
    monitor = DeepSpeedMonitor(engine, {
        "output_dir": str(Path(out) / "run"), "strict": True, "sinks": ["jsonl"], "stats": list(STATS),
        "watch": {"params": True, "activation_grads": True, "optimizer_state": ["exp_avg", "exp_avg_sq"]},
        "alerts": [{"rule": "non_finite"}, {"rule": "misreported_grad_norm", "tolerance": 1e-5}]})
    dp = world // stages
    data = iter([micro[engine.grid.get_data_parallel_id()] for micro in _batches(dp)])
    losses, norms = [], []  # DeepSpeed's grad norm: none on ZeRO-0 fp32
    for _ in range(STEPS):
        losses.append(float(engine.train_batch(data)))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    monitor.close()
    return {"records": [(r.step, dict(r.metrics), [(a.rule, a.phase, a.tag) for a in r.alerts])
                        for r in monitor.history],
            "micro_steps": [r.micro_steps for r in monitor.history],
            "names": [n for n, _ in model.named_parameters()], "losses": losses, "ds_norms": norms,
            "truth": truth(reference, dp) if rank == 0 else None}
