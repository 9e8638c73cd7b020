"""Clean training of models we did not write (transformers, random init, no download) under a
shipped config: the alerts raised (there should be none) and whether the model trains.

    python bench/clean_runs.py t5 full.yaml --steps 300 [--size small] [--fixed]

Sizes: `tiny` (what tests/test_clean_models.py runs: d_model 32, two layers) and `small` (T5:
t5-small's shape with a 1,024-token vocabulary; the others four times wider). Each run is one
process; figures are the alerts and the loss, not timings.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
import yaml

from msprobe_engine.monitor import Monitor

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
VOCAB, SEQ, BATCH = 128, 16, 4
#: size -> (width, layers, vocabulary)
SIZES = {"tiny": (32, 2, VOCAB), "small": (128, 4, 1024)}


def _t5(size: str) -> torch.nn.Module:
    if size == "small":  # t5-small's shape (d_model 512, 6+6 layers, 8 heads), a small vocabulary
        config = transformers.T5Config(vocab_size=SIZES[size][2], decoder_start_token_id=0, pad_token_id=0)
    else:
        config = transformers.T5Config(vocab_size=SIZES[size][2], d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                       num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def _gpt2(size: str) -> torch.nn.Module:
    width, layers, vocab = SIZES[size]
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=width,
                                                                n_layer=layers, n_head=4))


def _mixtral(size: str) -> torch.nn.Module:
    width, layers, vocab = SIZES[size]
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ))


def _resnet(size: str) -> torch.nn.Module:
    width = SIZES[size][0] // 4
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=width, hidden_sizes=[width, 2 * width], depths=[1, 1], num_labels=10))


MODELS: dict[str, Callable[[str], torch.nn.Module]] = {"t5": _t5, "gpt2": _gpt2, "mixtral": _mixtral,
                                                        "resnet": _resnet}


def batch(name: str, gen: torch.Generator, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """One training batch: images for ResNet; a repeated token pattern (learnable) otherwise."""
    if name == "resnet":
        return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=gen),
                "labels": torch.randint(0, 10, (BATCH,), generator=gen)}
    ids = torch.randint(1, vocab, (BATCH, 4), generator=gen).repeat(1, SEQ // 4)
    return {"input_ids": ids, "labels": ids.roll(1, 1) if name == "t5" else ids}


def train(name: str, config: str, out: Path, steps: int, size: str = "tiny",
          faults: Callable[[torch.nn.Module], Any] | None = None, fixed: bool = False) -> tuple[Monitor, list[float]]:
    """Train `name` for `steps` AdamW steps under `config` (`default` or a file in configs/), on a
    new batch each step (`fixed`: the first batch every step, which the model learns by heart).
    `faults(model)`, called before the monitor attaches, may return an object whose `step` is set
    before each forward (tests/health_models.Faults). Returns the closed monitor and the losses."""
    torch.manual_seed(0)
    model = MODELS[name](size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    injected = faults(model) if faults is not None else None  # before the monitor: its hooks see it
    data = yaml.safe_load((CONFIGS / config).read_text()) if config != "default" else {}
    data.update(output_dir=str(out), sinks=["jsonl"], control={"enabled": False}, incidents={"enabled": False})
    monitor = Monitor(data).attach(model, optimizer)
    gen = torch.Generator().manual_seed(1)
    losses = []
    first = batch(name, gen, SIZES[size][2])
    for step in range(steps):
        if injected is not None:
            injected.step = step
        loss = model(**(first if fixed or step == 0 else batch(name, gen, SIZES[size][2]))).loss
        optimizer.zero_grad()
        loss.backward()
        if torch.isfinite(loss):  # as a loss scaler would
            optimizer.step()
        monitor.step_end(loss)
        losses.append(float(loss.detach()))
    monitor.close()
    return monitor, losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("config", help="default, or a file in configs/ (full.yaml)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--fixed", action="store_true", help="one batch every step (learned by heart)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        monitor, losses = train(args.model, args.config, Path(out), args.steps, args.size, fixed=args.fixed)
        alerts = [e.as_dict() for e in monitor.alert_log]
    print(json.dumps({"model": args.model, "size": args.size, "config": args.config, "steps": args.steps,
                      "data": "fixed" if args.fixed else "fresh",
                      "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
                      "alerts": alerts, "seconds": round(time.perf_counter() - started, 1)}))
    return 1 if alerts else 0


if __name__ == "__main__":
    sys.exit(main())
