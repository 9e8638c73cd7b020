"""Clean training of models we did not write (transformers, random init, tiny configs, no
download): the shipped configs raise no alert; injected faults are still caught once each."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from health_models import Faults
from msprobe_engine.monitor import Monitor

transformers = pytest.importorskip("transformers")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
VOCAB, SEQ, BATCH = 128, 16, 4
STEPS = 150


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32,
                                                                n_layer=2, n_head=4))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ))


def _resnet():
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10))


MODELS = {"t5": _t5, "gpt2": _gpt2, "mixtral": _mixtral, "resnet": _resnet}


def _batch(name: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    if name == "resnet":
        return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=gen),
                "labels": torch.randint(0, 10, (BATCH,), generator=gen)}
    ids = torch.randint(1, VOCAB, (BATCH, 4), generator=gen).repeat(1, SEQ // 4)  # a repeated pattern: learnable
    return {"input_ids": ids, "labels": ids.roll(1, 1) if name == "t5" else ids}


def _train(name: str, config: str, out: Path, steps: int = STEPS, plan: dict | None = None):
    torch.manual_seed(0)
    model = MODELS[name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    faults = Faults(model, plan) if plan else None  # before the monitor: its hooks see the fault
    data = yaml.safe_load((CONFIGS / config).read_text()) if config != "default" else {}
    data.update(output_dir=str(out), sinks=["jsonl"], control={"enabled": False},
                incidents={"enabled": False})
    monitor = Monitor(data).attach(model, optimizer)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        if faults is not None:
            faults.step = step
        loss = model(**_batch(name, gen)).loss
        optimizer.zero_grad()
        loss.backward()
        if torch.isfinite(loss):  # as a loss scaler would
            optimizer.step()
        monitor.step_end(loss)
        losses.append(float(loss.detach()))
    monitor.close()
    return monitor, losses


@pytest.mark.slow
@pytest.mark.parametrize("config", ["default", "full.yaml"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_clean_training_of_a_model_we_did_not_write_raises_no_alert(tmp_path, name, config):
    monitor, losses = _train(name, config, tmp_path)
    assert losses[-1] < losses[0]  # it trains
    assert [(e.step, e.rule, e.tag) for e in monitor.alert_log] == []


@pytest.mark.slow
def test_injected_faults_in_a_moe_model_are_caught_once_each(tmp_path):
    layer = "model.layers.1.self_attn.o_proj"
    monitor, _ = _train("mixtral", "full.yaml", tmp_path, steps=100,
                        plan={50: (layer, "spike"), 80: (layer, "nan")})
    starts = [(e.step, e.rule) for e in monitor.alert_log if e.phase == "start"]
    assert starts == [(50, "spike"), (80, "non_finite")], starts
    tags = [e.tag for e in monitor.alert_log if e.phase == "start"]
    assert all(layer in tag for tag in tags), tags
