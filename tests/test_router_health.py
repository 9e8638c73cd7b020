"""Router health on a real transformers Mixtral (random init, no download): the expert loads
add up to tokens x top-k exactly, the model-level aux loss is transformers' own, and the collapse and dead-expert rules raise one alert each,
at the step the fault is injected, naming the layer and the experts; a clean run none."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from msprobe_integrations.torch import TorchMonitor

EXPERTS, TOP_K = 8, 2
BATCH, SEQ, MICRO = 4, 16, 2
STEPS, FAULT_STEP, LAYER = 8, 4, 1
ROUTER = f"model.layers.{LAYER}.mlp.gate"  # transformers 5's MixtralTopKRouter
RULES = [{"rule": "expert_collapse"}, {"rule": "dead_experts", "steps": 3}]


def _mixtral(aux: bool = False) -> torch.nn.Module:
    """`aux`: transformers computes the load-balancing loss (`output_router_logits`)."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                                        num_experts_per_tok=TOP_K, max_position_embeddings=64,
                                        router_aux_loss_coef=0.0, output_router_logits=aux)
    return transformers.MixtralForCausalLM(config)


def _bias_router(module: torch.nn.Module, bias: torch.Tensor) -> None:
    """From now on the router adds `bias` to its logits (the fault); the rest as transformers does."""
    original = module.forward

    def forward(hidden_states):
        logits, _, _ = original(hidden_states)
        logits = logits + bias
        probs = torch.softmax(logits.float(), dim=-1)
        top, indices = torch.topk(probs, module.top_k, dim=-1)
        return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), indices

    module.forward = forward


def _train(tmp_path, fault=None, sinks=("jsonl",), aux_losses: list | None = None) -> list:
    """The records of a run; `aux_losses`, when given, gets each step's aux losses as transformers
    returned them (one per micro-batch; the model then computes them)."""
    model = _mixtral(aux=aux_losses is not None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = TorchMonitor(model, optimizer, {"output_dir": str(tmp_path), "strict": True, "sinks": list(sinks),
                                              "alerts": RULES})
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        if step == FAULT_STEP and fault is not None:
            _bias_router(model.get_submodule(ROUTER), fault)
        for _ in range(MICRO):
            tokens = torch.randint(0, 64, (BATCH, SEQ), generator=gen)
            out = model(input_ids=tokens, labels=tokens)
            (out.loss / MICRO).backward()
            if aux_losses is not None:
                aux_losses.append(out.aux_loss.item())
        optimizer.step()
        optimizer.zero_grad()
        monitor.step_end()
    monitor.close()
    return list(monitor.history)


def _starts(records, rule: str) -> list:
    return [(r.step, a) for r in records for a in r.alerts if a.rule == rule and a.phase == "start"]


def test_loads_add_up_to_tokens_times_top_k_and_a_clean_run_raises_nothing(tmp_path):
    aux_losses: list[float] = []
    records = _train(tmp_path, aux_losses=aux_losses)
    routers = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    for record in records:
        m = record.metrics
        for path in routers:
            loads = [m[f"router/{path}/load/{e}"] for e in range(EXPERTS)]
            assert sum(loads) == BATCH * SEQ * MICRO * TOP_K  # exactly: counts, merged over micro-batches
            assert m[f"router/{path}/tokens"] == BATCH * SEQ * MICRO
            assert m[f"router/{path}/imbalance"] == pytest.approx(max(loads) / (sum(loads) / EXPERTS))
            assert 0.0 < m[f"router/{path}/entropy"] <= 1.0
            assert 1.0 / EXPERTS < m[f"router/{path}/topk_prob"] < 1.0  # the chosen beat the average
            assert m[f"router/{path}/dead"] == sum(load == 0 for load in loads)
        # transformers' one loss over both routers: a model-level row, the mean of the micro-batches'
        truth = aux_losses[record.step * MICRO:(record.step + 1) * MICRO]
        assert m["router/model/aux_loss"] == pytest.approx(sum(truth) / MICRO, rel=1e-6)
        assert not [tag for tag in m if tag.startswith("router/model/") and tag != "router/model/aux_loss"]
    assert len(aux_losses) == STEPS * MICRO and len(set(aux_losses)) > 1
    assert not [a for r in records for a in r.alerts]


def test_a_collapsed_router_raises_one_alert_at_that_step_naming_the_layer(tmp_path):
    bias = torch.zeros(EXPERTS)
    bias[3] = 30.0  # every token to expert 3; its second choice still spread over the others
    records = _train(tmp_path, bias)
    ((step, alert),) = _starts(records, "expert_collapse")
    assert step == FAULT_STEP and alert.tag == f"router/{ROUTER}/load/3" and alert.value == 1.0
    assert not _starts(records, "dead_experts")
    assert records[FAULT_STEP].metrics[f"router/{ROUTER}/imbalance"] == pytest.approx(EXPERTS / TOP_K)
    assert "router/model/aux_loss" not in records[0].metrics  # transformers computed none


def test_dead_experts_raise_one_alert_after_their_idle_steps_naming_them(tmp_path):
    bias = torch.zeros(EXPERTS)
    bias[[5, 6]] = -1e4  # experts 5 and 6 never chosen
    records = _train(tmp_path, bias)
    ((step, alert),) = _starts(records, "dead_experts")
    assert step == FAULT_STEP + 2  # the third step in a row without a token
    assert (alert.tag, alert.also) == (f"router/{ROUTER}/load/5", (f"router/{ROUTER}/load/6",))
    assert not _starts(records, "expert_collapse")
    assert all(records[s].metrics[f"router/{ROUTER}/dead"] == 2 for s in range(FAULT_STEP, STEPS))
    assert all(math.isfinite(r.metrics[f"router/{ROUTER}/entropy"]) for r in records)


def test_the_load_heatmap_shows_each_routers_experts_over_steps(tmp_path):
    import io

    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    bias = torch.zeros(EXPERTS)
    bias[[5, 6]] = -1e4  # experts 5 and 6 get no token from FAULT_STEP on
    _train(tmp_path, bias, sinks=[{"name": "router_heatmap", "every": STEPS}])
    (run_dir,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*.router_heatmap")}
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0}).Reload()
    tags = sorted(events.Tags()["tensors"])
    assert tags == [f"Heatmap/router_load/model.layers.{i}.mlp.gate/steps_0-{STEPS - 1}" for i in range(2)]
    (image,) = events.Tensors(tags[LAYER])  # TensorBoard's image plugin: width, height, PNG
    pixels = np.asarray(Image.open(io.BytesIO(image.tensor_proto.string_val[2])).convert("RGB"))
    height, width = pixels.shape[:2]
    ys = (2 * np.arange(EXPERTS) + 1) * height // (2 * EXPERTS)  # the centre of each cell: experts x steps
    xs = (2 * np.arange(STEPS) + 1) * width // (2 * STEPS)
    cells = pixels[ys][:, xs]
    bottom = cells[5, FAULT_STEP]  # an expert without tokens: the bottom of the scale
    assert (cells[5:7, FAULT_STEP:] == bottom).all()
    assert not (cells[5:7, :FAULT_STEP] == bottom).all(axis=-1).any()
    assert not (cells[:5, FAULT_STEP:] == bottom).all(axis=-1).any()


def _router_table(loads: list[float]):
    """A step's table holding one router's rows, as the router hooks make them."""
    from msprobe_engine.stats import router
    from msprobe_engine.stats.columns import empty_rows, index
    from msprobe_engine.stats.table import MetricKey, StatTable

    keys = [router.load_key("moe.gate", e) for e in range(len(loads))] + [MetricKey("router", "moe.gate", "entropy")]
    rows = empty_rows(len(keys))
    rows[:len(loads), index("sum")] = loads
    rows[:len(loads), index("sumsq")] = [x * x for x in loads]
    rows[:len(loads), index("numel")] = 1
    rows[-1, index("numel")] = sum(loads) / TOP_K  # tokens
    rows[-1, index("sum")] = 0.5 * rows[-1, index("numel")]
    return StatTable(keys, rows)


def test_dead_expert_counters_survive_a_restart_and_blame_the_dead_experts():
    from msprobe_engine.rules import RULES

    rule_class = RULES.get("dead_experts")
    rule = rule_class(rule_class.Config(rule="dead_experts", steps=3))
    idle = _router_table([4.0, 0.0, 4.0, 0.0])
    assert rule.evaluate(idle, {}, {}) == [] and rule.evaluate(idle, {}, {}) == []
    restarted = rule_class(rule_class.Config(rule="dead_experts", steps=3))
    restarted.load_state_dict(rule.state_dict())
    (firing,) = restarted.evaluate(idle, {}, {})  # the third idle step, counted across the restart
    assert (firing.tag, firing.also) == ("router/moe.gate/load/1", ("router/moe.gate/load/3",))
    assert restarted.blame(idle, None).tolist() == [False, True, False, True, False]
    assert restarted.evaluate(_router_table([4.0, 1.0, 2.0, 1.0]), {}, {}) == []  # back to life


def test_an_expert_without_tokens_is_no_deviation_for_incidents():
    """Incidents rank rows by their norm's fold change from its running average: a load of 0 would
    be an infinite fold. Router rows are left out of it (their rules judge them)."""
    from msprobe_engine.incident.deviation import RunningNorms

    norms = RunningNorms(warmup=1)
    norms.update(_router_table([4.0, 2.0, 4.0, 2.0]))
    assert norms.deviation(_router_table([4.0, 0.0, 6.0, 2.0])).tolist() == [1.0] * 5
