"""The toy framework itself: a tensor class, a model of linear layers and an optimizer, each
with the hooks a framework offers (a forward pre-hook, forward hooks, step pre/post hooks)."""
from __future__ import annotations

from typing import Callable

import numpy as np


class Tensor:
    """A float32 array."""

    requires_grad = False

    def __init__(self, data: np.ndarray) -> None:
        self.data = np.asarray(data, dtype=np.float32)

    @property
    def dtype(self) -> str:
        return str(self.data.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape


class Model:
    """``y = (x @ W0) @ W1``; `forward_hooks` get (layer name, output), `pre_hooks` nothing."""

    def __init__(self, sizes: tuple[int, ...] = (3, 4, 2), seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.weights = {f"fc{i}": Tensor(rng.standard_normal((a, b))) for i, (a, b) in
                        enumerate(zip(sizes, sizes[1:]))}
        self.pre_hooks: list[Callable[[], None]] = []
        self.forward_hooks: list[Callable[[str, Tensor], None]] = []
        self.inputs: dict[str, Tensor] = {}

    def __call__(self, x: Tensor) -> Tensor:
        for hook in self.pre_hooks:
            hook()
        for name, weight in self.weights.items():
            self.inputs[name] = x
            x = Tensor(x.data @ weight.data)
            for hook in self.forward_hooks:
                hook(name, x)
        return x

    def backward(self, y: Tensor) -> dict[str, Tensor]:
        """The gradients of ``mean(y ** 2)`` by weight name."""
        grad = 2 * y.data / y.data.size
        grads = {}
        for name in reversed(list(self.weights)):
            grads[name] = Tensor(self.inputs[name].data.T @ grad)
            grad = grad @ self.weights[name].data.T
        return grads


class SGD:
    """`step(grads)`: each pre-hook may say skip (returns True); post-hooks run after either way."""

    def __init__(self, model: Model, lr: float = 0.1) -> None:
        self.model = model
        self.lr = lr
        self.pre_hooks: list[Callable[[dict[str, Tensor]], bool]] = []
        self.post_hooks: list[Callable[[], None]] = []

    def step(self, grads: dict[str, Tensor]) -> None:
        skip = any([hook(grads) for hook in self.pre_hooks])
        if not skip:
            for name, grad in grads.items():
                weight = self.model.weights[name]
                weight.data = weight.data - np.float32(self.lr) * grad.data
        for hook in self.post_hooks:
            hook()
