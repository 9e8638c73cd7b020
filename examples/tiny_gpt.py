"""A small GPT-like model and synthetic data, shared by the demo, tests and benchmarks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class GPTConfig:
    vocab: int = 256
    dim: int = 128
    heads: int = 4
    layers: int = 2
    seq: int = 64
    batch: int = 8


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = nn.MultiheadAttention(cfg.dim, cfg.heads, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)
        self.register_buffer("mask", torch.triu(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool), 1))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, self.mask[: tokens.shape[1], : tokens.shape[1]])
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def synthetic_batches(cfg: GPTConfig, steps: int, seed: int = 0):
    """Deterministic token batches with a learnable pattern (next token = token + 1)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=gen)
        tokens = (start + torch.arange(cfg.seq + 1)) % cfg.vocab
        yield tokens[:, :-1], tokens[:, 1:]


def inject(model: nn.Module, layer: str, step_of: callable, at_step: int, kind: str = "nan", *,
           traced: bool = False):
    """Make module `layer` emit nan/inf (or a x1000 spike) in its output at optimizer step `at_step`.

    `step_of()` returns the current step. Returns the hook handle. `traced`: the step is compared
    as a tensor inside the hook (`step_tensor`), so a compiled forward compiles once instead of
    guarding on the Python step (a recompilation at every step).
    """
    module = model.get_submodule(layer)
    step = step_tensor(model, step_of) if traced else None

    def corrupt(mod, args, output):
        if step is None and step_of() != at_step:
            return None
        out = output[0] if isinstance(output, tuple) else output
        if step is not None:
            bad = corrupt_where(out, step == at_step, kind)
        elif kind == "spike":
            bad = out * 1000.0
        else:
            bad = out.clone(memory_format=torch.contiguous_format)  # view(-1) needs contiguous
            bad.view(-1)[0] = float("nan") if kind == "nan" else float("inf")
        return (bad, *output[1:]) if isinstance(output, tuple) else bad

    return module.register_forward_hook(corrupt)


def step_tensor(model: nn.Module, step_of: callable) -> torch.Tensor:
    """A 0-d tensor holding `step_of()`, refreshed by a forward pre-hook on `model` (which runs
    eagerly when the model's forward is compiled): hooks traced into the graph compare it there."""
    step = torch.zeros((), dtype=torch.int64)

    def refresh(mod, args):
        step.fill_(step_of())

    model.register_forward_pre_hook(refresh)
    return step


def corrupt_where(x: torch.Tensor, hit: torch.Tensor, kind: str) -> torch.Tensor:
    """`x` where `hit` (a bool 0-d tensor) is false; else its first value nan/inf (`kind`), or
    every value x1000 (`spike`): elementwise ops only, the same values as the eager corruption."""
    if kind == "spike":
        return torch.where(hit, x * 1000.0, x)
    first = torch.arange(x.numel(), device=x.device).view(x.shape) == 0
    return torch.where(hit & first, float("nan") if kind == "nan" else float("inf"), x)
