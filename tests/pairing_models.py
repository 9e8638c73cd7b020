"""Models we did not write, for the round trips with the predecessor (tests/test_pairing_models.py):
a self-attention LM on nn.MultiheadAttention(x, x, x) (bench/models.py's `small_lm`, the
predecessor's kind of test model) and transformers' ResNet (BatchNorm), Mixtral (mixture of
experts) and T5 (encoder-decoder), from tiny random-init configs (no download).

`train_step(name, debugger)` builds the model from seed 0 and runs one training step (forward,
backward, Adam) with ``start(model)`` / ``stop()`` / ``step()`` around it; it returns the loss.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

Forward = Callable[[], torch.Tensor]


def _small_lm() -> tuple[torch.nn.Module, Forward]:
    from bench.models import SmallLM
    model = SmallLM(vocab=64, dim=32, layers=2, heads=2, seq=8)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(tokens, tokens.roll(1, 1))


def _resnet() -> tuple[torch.nn.Module, Forward]:
    import transformers
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                       layer_type="basic", num_labels=4)
    model = transformers.ResNetForImageClassification(config)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 3])
    return model, lambda: model(pixel_values=pixels, labels=labels).loss


def _mixtral() -> tuple[torch.nn.Module, Forward]:
    import transformers
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=16)
    model = transformers.MixtralForCausalLM(config)
    tokens = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(input_ids=tokens, labels=tokens).loss


def _t5() -> tuple[torch.nn.Module, Forward]:
    import transformers
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                                   num_heads=2, dropout_rate=0.0, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 64, (2, 6), generator=g), torch.randint(0, 64, (2, 5), generator=g)
    return model, lambda: model(input_ids=ids, labels=labels).loss


BUILDERS: dict[str, Callable[[], tuple[torch.nn.Module, Forward]]] = {
    "mha_lm": _small_lm, "resnet": _resnet, "mixtral": _mixtral, "t5": _t5}


def train_step(name: str, debugger: Any = None) -> torch.Tensor:
    """One training step of model `name` from seed 0 under `debugger`; the loss."""
    torch.manual_seed(0)
    model, forward = BUILDERS[name]()
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if debugger is not None:
        debugger.start(model)
    loss = forward()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if debugger is not None:
        debugger.stop()
        debugger.step()
    return loss.detach()
