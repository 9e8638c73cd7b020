"""Models for the overhead suite, none of them written for the tool: a small LM in the
predecessor's style (nn.MultiheadAttention blocks), and transformers' GPT-2 and Llama from
random-init configs (no download), each in a small (~1M) and a medium (~20M) size; beside
them transformers' ResNet (a CNN with BatchNorm) and Mixtral (a mixture-of-experts decoder), ~1M.

`build(name)` returns the model and a function that runs its forward on a fixed batch and
returns the loss. Dropout is off, so that every mode of a run trains the very same way.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

Forward = Callable[[], torch.Tensor]


class Block(nn.Module):
    """Pre-norm transformer block: nn.MultiheadAttention and a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class SmallLM(nn.Module):
    """The predecessor's kind of test LM: embedding, blocks, final norm, head, cross-entropy."""

    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 4, heads: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, self.mask)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _tokens(vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _hf(kind: str, medium: bool) -> tuple[nn.Module, Forward]:
    import transformers

    vocab, dim, layers, seq, batch = (8192, 384, 10, 64, 4) if medium else (1024, 128, 4, 32, 8)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=dim, n_layer=layers, n_head=dim // 64,
                                         n_positions=seq, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=dim * 8 // 3,
                                          num_hidden_layers=layers - 2 if medium else layers,
                                          num_attention_heads=dim // 64, num_key_value_heads=max(1, dim // 128),
                                          max_position_embeddings=seq)
        model = transformers.LlamaForCausalLM(config)
    tokens = _tokens(vocab, batch, seq)
    return model, lambda: model(input_ids=tokens, labels=tokens).loss


def _resnet() -> tuple[nn.Module, Forward]:
    import transformers

    config = transformers.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                                       layer_type="basic", num_labels=10)
    model = transformers.ResNetForImageClassification(config)
    images = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    return model, lambda: model(pixel_values=images, labels=labels).loss


def _mixtral() -> tuple[nn.Module, Forward]:
    import transformers

    config = transformers.MixtralConfig(vocab_size=1024, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32)
    model = transformers.MixtralForCausalLM(config)
    tokens = _tokens(1024, 8, 32)
    return model, lambda: model(input_ids=tokens, labels=tokens).loss


def _small_lm() -> tuple[nn.Module, Forward]:
    model = SmallLM()
    tokens, targets = _tokens(512, 8, 32), _tokens(512, 8, 32).roll(1, 1)
    return model, lambda: model(tokens, targets)


BUILDERS: dict[str, Callable[[], tuple[nn.Module, Forward]]] = {
    "small_lm": _small_lm,
    "gpt2-1m": lambda: _hf("gpt2", False),
    "llama-1m": lambda: _hf("llama", False),
    "gpt2-20m": lambda: _hf("gpt2", True),
    "llama-20m": lambda: _hf("llama", True),
    "resnet-1m": _resnet,
    "mixtral-1m": _mixtral,
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, Forward]:
    """The model `name` (a key of BUILDERS), initialised from `seed`, and its forward."""
    torch.manual_seed(seed)
    model, forward = BUILDERS[name]()
    model.train()
    return model, forward
