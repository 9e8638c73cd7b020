"""Global expert names under DeepSpeed expert parallelism (`msprobe_integrations.deepspeed.experts`):
the pure naming, on the names DeepSpeed's `MoE` gives its experts' parameters (the two-rank runs
are in tests/test_deepspeed_moe.py)."""
from __future__ import annotations

from msprobe_integrations.deepspeed.experts import ExpertLayer, global_names


def _local(head: str, experts: int) -> list[str]:
    return [f"{head}{j}.{tail}" for j in range(experts) for tail in ("0.weight", "2.bias")]


def test_every_expert_is_listed_once_under_its_global_number_and_others_are_placeholders():
    first = "layers.0.moe.deepspeed_moe.experts.deepspeed_experts."
    second = "layers.1.moe.deepspeed_moe.experts.deepspeed_experts."
    # rank 1 holds experts 2-3 of the first layer (ep_size 2, 4 experts) and of the second (ep_size 4, 8 experts)
    layers = [ExpertLayer(first, local=2, ep_rank=1, ep_size=2, edp_group=None),
              ExpertLayer(second, local=2, ep_rank=1, ep_size=4, edp_group=None)]
    gate = "layers.0.moe.deepspeed_moe.gate.wg.weight"
    names = ["embed.weight", *_local(first, 2), gate, *_local(second, 2), "head.weight"]
    full, index = global_names(names, layers)
    assert full == ["embed.weight", *_local(first, 4), gate, *_local(second, 8), "head.weight"]
    own = {name: names[at] for name, at in zip(full, index) if at is not None}
    assert own == {"embed.weight": "embed.weight", "head.weight": "head.weight", gate: gate,
                   **{f"{head}{1 * 2 + j}.{tail}": f"{head}{j}.{tail}" for head in (first, second)
                      for j in range(2) for tail in ("0.weight", "2.bias")}}

