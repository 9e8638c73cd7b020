"""free_benchmark for MindSpore (PyNative, L1): each selected API call is run again on perturbed inputs.

The API interception (`capture.apis`) routes every dumped API call through its Cell; this
handler takes the place of the dump's recorder there. A selected call (a dumped API, not a
communication, not writing into its arguments (``Tensor.add_``, ``__iadd__``, ``__setitem__``...),
not drawing random numbers (dropout, ``rand*``, ``normal``...: a rerun would draw others), with
a floating-point tensor argument):

- ``check``, forward: the call runs as usual (training gets its result, unchanged), then
  once more, outside autodiff (`ops.stop_gradient` on the copies), on perturbed inputs; each
  floating output's ratio (`dump.free_benchmark_files`) is kept as a 0-dim MindSpore tensor
  and all of a step's are read in one host transfer at `step()`; failing outputs go to
  ``free_benchmark.csv`` (the predecessor's MindSpore columns: ``pert_type``, dtypes such as
  ``Float32``, shapes such as ``(5, 8)``, an empty rank outside a distributed run);
- ``check``, backward (as the predecessor does for MindSpore): the input gradients of the
  call for an all-ones output gradient (`mindspore.vjp`), of the original and of the perturbed
  inputs, compared the same way, under ``<name>.backward``;
- ``fix``: the call's output is replaced by the output on the more precise inputs
  (improve_precision), cast back to the original dtypes.

Perturbations, on the first floating tensor argument (or every tensor of the first list/dict
argument), as for PyTorch: improve_precision (float16/bfloat16 -> float32, every floating input;
float32 -> float64 only with ``improve_float32: true``), add_noise, bit_noise, change_value, no_change. ``to_cpu`` (and
``fuzz_device: cpu``) are PyTorch's: refused when the session is made. ``if_preheat`` works
as for PyTorch (`Judge`; the predecessor's MindSpore side has no preheat).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import mindspore as ms
from mindspore import Tensor, ops

from msprobe_engine.dump.free_benchmark import FreeBenchmarkRecorder, map_tensors
from msprobe_engine.dump.free_benchmark_files import NOISE as NOISE_BY_NAME, Compared, tolerance
from msprobe_engine.dump.recorder import RecorderContext
from msprobe_engine.dump.writer import StepData
from msprobe_engine.frameworks.mindspore.capture.gated import GatedRecorder
from msprobe_engine.stats import empty_rows

#: the CSV's header on MindSpore (the predecessor's MindSpore side calls pert_mode "pert_type")
HEADER = ("rank", "pert_type", "stage", "step", "api_name", "max_rel", "dtype", "shape", "output_index")
#: pert_mode values MindSpore does not run (PyTorch's: every input on the CPU)
PYTORCH_ONLY = ("to_cpu",)
HIGHER = {ms.float16: ms.float32, ms.bfloat16: ms.float32}
HIGHER_FLOAT32 = {**HIGHER, ms.float32: ms.float64}  # improve_float32: true
BITS = {ms.bfloat16: ms.int16, ms.float16: ms.int16, ms.float32: ms.int32, ms.float64: ms.int64}
NEUTRAL = {ms.float16: "float16", ms.bfloat16: "bfloat16", ms.float32: "float32", ms.float64: "float64"}
NOISE = {dtype: NOISE_BY_NAME[name] for dtype, name in NEUTRAL.items()}
SMALLEST_NORMAL = {ms.float16: 6.103515625e-05, ms.bfloat16: 1.1754943508222875e-38,
                   ms.float32: 1.1754943508222875e-38, ms.float64: 2.2250738585072014e-308}
#: APIs that draw random numbers (a rerun draws other ones): not perturbed (names start so, or are these)
RANDOM_PREFIXES = ("dropout", "rand", "random")
RANDOM = frozenset(("normal", "normal_", "uniform", "uniform_", "bernoulli", "bernoulli_", "multinomial", "shuffle",
                    "gamma", "poisson", "standard_normal", "standard_laplace", "laplace", "log_uniform_candidate_sampler"))
#: APIs that write into an argument (besides ``*_`` methods and in-place operators)
WRITES = ("assign", "assign_add", "assign_sub", "scatter_update", "scatter_nd_update", "__setitem__")
DISTRIBUTED = ("Distributed.", "MintDistributed.")


def _floating(t: Any) -> bool:
    return isinstance(t, Tensor) and t.dtype in NEUTRAL and t.size > 0


def _map(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    return map_tensors(value, Tensor, fn)


def _target(args: tuple) -> int:
    """The position of the argument perturbed (the predecessor's choice; -1: none)."""
    for i, arg in enumerate(args):
        if _floating(arg):
            return i
        if isinstance(arg, (list, tuple, dict)):
            return i
    return -1


def _add_noise(t: Tensor) -> Tensor:
    if not _floating(t):
        return t
    noise = NOISE[t.dtype]
    return ops.where(ops.abs(t) > noise ** 0.5, t + noise, t).astype(t.dtype)


def _bit_noise(t: Tensor) -> Tensor:
    if not _floating(t):
        return t
    bits = t.view(BITS[t.dtype])
    flipped = ops.bitwise_xor(bits, ops.ones_like(bits)).view(t.dtype)
    return ops.where(ops.abs(t) > SMALLEST_NORMAL[t.dtype], flipped, t)


def _change_value(t: Tensor) -> Tensor:
    if not _floating(t) or t.ndim == 0 or t.shape[0] < 2 or (t.ndim > 1 and t.shape[1] < 2):
        return t
    out = t.copy()
    first, last = (0, -1) if t.ndim == 1 else ((0, 0), (-1, -1))
    out[first], out[last] = t[last].copy(), t[first].copy()
    return out


def _higher(t: Tensor) -> Tensor:
    return t.astype(HIGHER[t.dtype]) if t.dtype in HIGHER else t


def _higher_float32(t: Tensor) -> Tensor:
    return t.astype(HIGHER_FLOAT32[t.dtype]) if t.dtype in HIGHER_FLOAT32 else t


#: pert_mode -> (the tensor perturbation, whether it applies to every input rather than the target)
PERTURBATIONS: dict[str, tuple[Callable[[Tensor], Tensor], bool]] = {
    "improve_precision": (_higher, True), "add_noise": (_add_noise, False), "bit_noise": (_bit_noise, False),
    "change_value": (_change_value, False), "no_change": (lambda t: t, False),
}


def perturb(mode: str, args: tuple, kwargs: dict, index: int, float32: bool = False) -> tuple[tuple, dict]:
    """Perturbed copies of a call's arguments (`float32`: improve_precision raises float32 too)."""
    fn, every = (_higher_float32, True) if float32 and mode == "improve_precision" else PERTURBATIONS[mode]
    if every:
        return _map(args, fn), _map(kwargs, fn)
    return args[:index] + (_map(args[index], fn),) + args[index + 1:], kwargs


def ratio(original: Tensor, perturbed: Tensor, tol: float) -> Tensor:
    """The worst elementwise ratio of two outputs, >= 1 (0-dim float64; nan/inf -> 1)."""
    o = ops.abs(original.astype(perturbed.dtype))
    p = ops.abs(perturbed)
    r = (o + tol) / (p + tol)
    r = ops.where(ops.maximum(o, p) > tol, ops.maximum(r, 1 / r), ops.ones_like(r))
    worst = r.max().astype(ms.float64)
    return ops.where(ops.isfinite(worst), worst, ops.ones_like(worst))


def _outputs(value: Any) -> list[tuple[int | None, Tensor]]:
    if isinstance(value, Tensor):
        return [(None, value)] if _floating(value) else []
    if isinstance(value, (list, tuple)):
        return [(i, v) for i, v in enumerate(value) if _floating(v)]
    return []


def _shape(t: Tensor) -> str:
    return str(tuple(t.shape))


def skipped(key: str) -> bool:
    """APIs never perturbed: collectives, calls writing into their arguments, random draws."""
    parts = [part.lower() for part in key.split(".")[1:]]  # Primitive.<attribute>.<Class>: both
    api = key.split(".")[1]
    return (key.startswith(DISTRIBUTED) or api in WRITES or (api.startswith("__i") and api != "__invert__")
            or (api.endswith("_") and not api.endswith("__"))
            or any(part.startswith(RANDOM_PREFIXES) or part in RANDOM for part in parts))


class MindSporeFreeBenchmark(FreeBenchmarkRecorder, GatedRecorder):
    """The MindSpore free_benchmark handler of the API routes."""

    def __init__(self, ctx: RecorderContext) -> None:
        self._depth = 0
        super().__init__(ctx, ctx.rank)
        self.replaces_outputs = self.options.handler_type == "fix"  # see `ApiHooks._cell`

    def _reset(self) -> None:
        super()._reset()
        self._depth = 0

    def _guard(self, name: str) -> contextlib.AbstractContextManager:
        """The handler's own MindSpore calls are not routed; an error is logged once per API and
        the call is left as it ran (strict: raised)."""
        return self._gated(lambda exc: self._skip(name, exc))

    # ---- the API routes' hooks ----------------------------------------------------------------
    def api_begin(self, key: str) -> None:
        if self._active:
            self._depth += 1

    def api_end(self, key: str, args: tuple, kwargs: dict, output: Any, func: Callable | None = None) -> Any:
        """After the call: compare (check) or return the replacing output (fix)."""
        if not self._active or self._depth == 0:
            return None
        self._depth -= 1
        if self._depth or func is None:
            return None  # a call inside a routed call, as in the dump: not counted
        name, wanted = self._call(key)
        index = _target(args)
        if not wanted or index < 0 or skipped(key):
            return None
        fixed = None
        with self._guard(name):
            if self.options.handler_type == "fix":
                fixed = self._fixed(func, args, kwargs, index, output)
            elif self.options.fuzz_stage == "forward":
                self._check_forward(func, args, kwargs, index, name, output)
            else:
                self._check_backward(func, args, kwargs, index, name)
        return fixed

    def api_backward(self, key: str, grad_input: Any, grad_output: Any) -> None:
        """Backward data is not needed: the backward stage is checked at the forward call."""

    def forward_done(self) -> None:
        """Nothing waits for the end of a forward pass."""

    # ---- the checks --------------------------------------------------------------------------
    def _check_forward(self, func: Callable, args: tuple, kwargs: dict, index: int, name: str, output: Any) -> None:
        p_args, p_kwargs = perturb(self.options.pert_mode, args, kwargs, index, self.options.improve_float32)
        p_args, p_kwargs = _map(p_args, ops.stop_gradient), _map(p_kwargs, ops.stop_gradient)
        self._compare(name, "forward", output, func(*p_args, **p_kwargs))

    def _compare(self, name: str, stage: str, original: Any, perturbed: Any) -> None:
        pert = dict(_outputs(perturbed))
        for i, out in _outputs(original):
            if i in pert and pert[i].shape == out.shape:
                dtype = NEUTRAL[out.dtype]
                self._pending.append((Compared(name, stage, dtype, str(out.dtype), _shape(out), i),
                                      ratio(out, pert[i], tolerance(dtype, stage))))

    def _check_backward(self, func: Callable, args: tuple, kwargs: dict, index: int, name: str) -> None:
        positions = [i for i, a in enumerate(args) if _floating(a)]
        if not positions:
            return
        original = _input_grads(func, args, kwargs, positions)
        p_args, p_kwargs = perturb(self.options.pert_mode, args, kwargs, index, self.options.improve_float32)
        perturbed = _input_grads(func, p_args, p_kwargs, positions)
        backward = name.replace(".forward", ".backward")
        for j, (o, p) in enumerate(zip(original, perturbed)):
            if _floating(o) and _floating(p) and o.shape == p.shape:
                dtype = NEUTRAL[o.dtype]
                self._pending.append((Compared(backward, "backward", dtype, str(o.dtype), _shape(o),
                                               j if len(original) > 1 else None),
                                      ratio(o, p, tolerance(dtype, "backward"))))

    def _fixed(self, func: Callable, args: tuple, kwargs: dict, index: int, output: Any) -> Any:
        """fix mode: the call on the more precise inputs, each floating output cast back to the
        original output's dtype (None when the output has no floating tensor: it stays)."""
        if not _outputs(output):
            return None
        p_args, p_kwargs = perturb(self.options.pert_mode, args, kwargs, index, self.options.improve_float32)
        precise = func(*p_args, **p_kwargs)
        return _cast_like(precise, output)

    # ---- step end ------------------------------------------------------------------------------
    def finish_step(self) -> StepData:
        """Read the step's ratios (one host transfer), write the failing outputs."""
        pending, step = self._pending, self._step
        self._step += 1
        self._reset()
        if pending:
            with self._guard("step end"):
                ratios = ops.stack([r for _, r in pending]).asnumpy()
                self.transfers += 1
                self._submit(step, [c for c, _ in pending], ratios.tolist(), HEADER)
        return StepData({}, {}, None, empty_rows(), write_empty=False)


def _input_grads(func: Callable, args: tuple, kwargs: dict, positions: list[int]) -> list[Any]:
    """The gradients of the call's floating tensor arguments for an all-ones output gradient."""
    def call(*tensors: Tensor) -> Any:
        full = list(args)
        for i, t in zip(positions, tensors):
            full[i] = t
        return func(*full, **kwargs)

    outputs, vjp_fn = ms.vjp(call, *[args[i] for i in positions])
    grads = vjp_fn(_map(outputs, ops.ones_like))
    return list(grads) if isinstance(grads, (tuple, list)) else [grads]


def _cast_like(value: Any, like: Any) -> Any:
    if isinstance(value, Tensor) and isinstance(like, Tensor):
        return value.astype(like.dtype) if value.dtype != like.dtype else value
    if isinstance(value, (list, tuple)) and isinstance(like, (list, tuple)) and len(value) == len(like):
        return type(like)(_cast_like(v, l) for v, l in zip(value, like))
    return like
