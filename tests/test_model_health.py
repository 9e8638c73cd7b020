"""Model-health signals (`watch.health`, one registered file each) on a transformers GPT-2 (eager
attention), each against the same quantity computed here by other means; off by default, and the
losses bitwise the same with every signal on (collectives: tests/test_health_collectives.py)."""
from __future__ import annotations

import math

import pytest
import torch

from msprobe_engine import Monitor
from msprobe_engine.errors import ConfigError

SEQ, BATCH = 12, 2
ALL_ON = {"attention_entropy": True, "stable_rank_every": 2, "stable_rank_iterations": 60, "mg_direction": True,
          "micro_batch_grads": True, "collectives": True}


def _gpt2(seed: int = 0, attention: str = "eager"):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attention)
    return GPT2LMHeadModel(config)


def _batches(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (BATCH, SEQ), generator=g) for _ in range(count)]


def _train(health: dict | None, steps: int = 3, gas: int = 2, probe=None, attention: str = "eager"):
    """(losses, records) of `steps` AdamW steps of `gas` micro-batches; `health`: watch.health
    (None: no monitor); `probe(model, opt, step, micro)` runs before each micro-batch."""
    model = _gpt2(attention=attention)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = None
    if health is not None:
        monitor = Monitor({"output_dir": "/tmp/unused", "run_name": "x", "sinks": [], "strict": True,
                           "stats": ["mean", "max", "min", "norm"], "watch": {"health": health}}).attach(model, opt)
    losses, records = [], []
    batches = iter(_batches(steps * gas))
    for step in range(steps):
        for micro in range(gas):
            ids = next(batches)
            if probe is not None:
                probe(model, opt, step, micro, ids)
            loss = model(input_ids=ids, labels=ids).loss / gas
            loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
        if monitor is not None:
            records.append(monitor.step_end())
    if monitor is not None:
        monitor.close()
    return losses, records


def test_off_by_default_and_losses_bitwise_with_every_signal_on():
    plain, _ = _train(None)
    off_losses, off = _train({})
    on_losses, on = _train(ALL_ON)
    assert all(torch.equal(a, b) for a, b in zip(plain, off_losses))
    assert all(torch.equal(a, b) for a, b in zip(plain, on_losses))
    assert not [t for r in off for t in r.metrics if t.startswith("health/") or "mg_direction" in t]
    assert [t for t in on[0].metrics if t.startswith("health/")]
    assert on[0].metrics["comm/all_reduce/calls/max"] == 0  # one process: no collective
    assert not [t for r in off for t in r.metrics if t.startswith("comm/")]


def test_every_health_key_belongs_to_one_registered_signal():
    from dataclasses import fields

    from msprobe_engine.config.schema import ModelHealth
    from msprobe_engine.frameworks.torch.health_hooks import SIGNALS

    owned = [name for _, signal in SIGNALS for name in (signal.key, *signal.options)]
    assert sorted(owned) == sorted(f.name for f in fields(ModelHealth))
    assert {name for name, _ in SIGNALS} >= {"attention_entropy", "stable_rank", "mg_direction", "micro_batch_grads",
                                             "collectives"}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_attention_entropy_is_that_of_the_attention_probabilities(attention):
    """eager: of every query; SDPA: recomputed from q and k for the first batch element (all 12
    queries here: fewer than SAMPLED_QUERIES); against the eager attention's own probabilities."""
    expected = {}
    reference = _gpt2(attention="eager")  # the same weights as the trained model's at step 0, no monitor on it

    def probe(model, opt, step, micro, ids):
        if step == 0:
            with torch.no_grad():
                attentions = reference(input_ids=ids, output_attentions=True).attentions
            for layer, p in enumerate(attentions):
                p = p if attention == "eager" else p[:1]
                entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
                expected.setdefault(layer, []).append((entropy, p.amax(-1)))

    _, records = _train({"attention_entropy": True}, steps=1, probe=probe, attention=attention)
    metrics = records[0].metrics
    for layer, pairs in expected.items():
        entropy = torch.cat([e.flatten() for e, _ in pairs])
        top = torch.cat([m.flatten() for _, m in pairs])
        path = f"transformer.h.{layer}.attn"
        assert math.isclose(metrics[f"health/{path}/attn_entropy/mean"], entropy.mean().item(), rel_tol=1e-5)
        assert math.isclose(metrics[f"health/{path}/attn_entropy/max"], entropy.max().item(), rel_tol=1e-5)
        assert math.isclose(metrics[f"health/{path}/attn_max_prob/min"], top.min().item(), rel_tol=1e-5)
        assert 0 <= metrics[f"health/{path}/attn_entropy/min"] and entropy.max() <= math.log(SEQ) + 1e-5
    assert metrics[f"health/transformer.h.0.attn/attn_max_prob/max"] == pytest.approx(1.0)  # the first query sees one key


def test_stable_rank_on_its_cadence_matches_the_spectral_norm():
    expected = {}

    def probe(model, opt, step, micro, ids):
        if micro == 0:
            w = model.transformer.h[0].mlp.c_fc.weight.detach()
            expected[step] = (w.square().sum() / torch.linalg.matrix_norm(w, ord=2) ** 2).item()

    _, records = _train({"stable_rank_every": 2, "stable_rank_iterations": 60}, steps=3, probe=probe)
    tag = "health/transformer.h.0.mlp.c_fc.weight/stable_rank/mean"
    assert tag in records[0].metrics and tag in records[2].metrics and tag not in records[1].metrics
    for step in (0, 2):
        assert records[step].metrics[tag] == pytest.approx(expected[step], rel=1e-3)
    assert not [t for t in records[0].metrics if t.startswith("health/transformer.h.0.ln_1.weight")]  # 1-D: none


def test_mg_direction_is_the_predecessors_sign_agreement():
    expected = {}

    def check(opt, args, kwargs):
        step = len(expected)
        expected[step] = {}
        for group in opt.param_groups:
            for p in group["params"]:
                m = opt.state.get(p, {}).get("exp_avg")
                if m is not None:
                    expected[step][id(p)] = (((p.grad.sign() * m.sign()).sum() / m.numel() + 1) / 2).item()

    model_ref = {}

    def probe(model, opt, step, micro, ids):
        if step == 0 and micro == 0:
            opt.register_step_pre_hook(check)
            model_ref["model"] = model

    _, records = _train({"mg_direction": True}, steps=3, probe=probe)
    assert not [t for t in records[0].metrics if "mg_direction" in t]  # no moment before the first step
    names = {id(p): n for n, p in model_ref["model"].named_parameters()}
    for step in (1, 2):
        assert len(expected[step]) > 10
        for pid, value in expected[step].items():
            for stat in ("mean", "min", "max"):  # one number per parameter, as the predecessor's
                assert records[step].metrics[f"optim/{names[pid]}/mg_direction/{stat}"] == pytest.approx(value, abs=1e-6)


def test_micro_batch_gradient_norms():
    seen = []  # the accumulated gradients before micro-batch 2, and before the optimizer step

    def gradients(model):
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    def probe(model, opt, step, micro, ids):
        if step == 0 and micro == 1:
            seen.append(gradients(model))
            opt.register_step_pre_hook(lambda opt, args, kwargs: seen.append(gradients(model)) if len(seen) == 1 else None)

    _, records = _train({"micro_batch_grads": True}, steps=2, gas=2, probe=probe)
    first, total = seen
    expected = [math.sqrt(sum(g.double().square().sum().item() for g in grads))
                for grads in (first, [b - a for a, b in zip(first, total)])]
    metrics = records[0].metrics
    assert metrics["health/grad_micro_batch/1/norm"] == pytest.approx(expected[0], rel=1e-5)
    assert metrics["health/grad_micro_batch/2/norm"] == pytest.approx(expected[1], rel=1e-4)
    assert expected[0] != pytest.approx(expected[1], rel=1e-3)  # two different batches
    assert "health/grad_micro_batch/3/norm" not in metrics and "health/grad_micro_batch/1/norm" in records[1].metrics


def test_bad_values_are_named():
    with pytest.raises(ConfigError, match="stable_rank_every"):
        Monitor({"sinks": [], "watch": {"health": {"stable_rank_every": -1}}})
    with pytest.raises(ConfigError, match="attention_entropy"):
        Monitor({"sinks": [], "watch": {"health": {"attention_entropy": "yes"}}})
