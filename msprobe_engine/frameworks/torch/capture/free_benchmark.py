"""free_benchmark for PyTorch: each selected API call is run again on perturbed inputs.

The API mode hands every torch call here. A selected call (an API the dump records, with a
floating-point tensor input, not writing into its arguments, outside a backward pass):

- ``check``, forward: the call runs as usual (its result is what training gets, unchanged),
  then once more, without gradients and with the random state restored, on perturbed copies
  of its inputs; each floating output's ratio (`dump.free_benchmark_files`) is kept on the
  device and read once per step, and the failing outputs are written to free_benchmark.csv;
- ``check``, backward: the call's output gets a gradient hook that computes the input
  gradients of the original and of the perturbed inputs for the incoming gradient, compared
  the same way;
- ``fix``: the call runs only on the more precise inputs (improve_precision, to_cpu) and its
  output, cast back to the original dtype and device, replaces the original one (gradients
  flow through the casts).

Perturbations (the first floating tensor argument, or every tensor of the first list/dict
argument, as the predecessor): improve_precision (float16/bfloat16 -> float32, every floating
input; float32 is left alone as in the predecessor, or raised to float64 with the section's
``improve_float32: true``), add_noise (+noise on values above its square root),
bit_noise (last mantissa bit flipped on normal values), change_value (first and last
elements swapped), no_change, to_cpu (every input on the CPU).

With ``if_preheat``, the first ``preheat_step`` steps only sample (at most ``max_sample``
calls per API) and each API's threshold becomes the largest of its dtype threshold and the
ratios sampled (ours: a simpler preheat than the predecessor's).
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Iterator

import numpy as np
import torch

from msprobe_engine.dump.free_benchmark import FreeBenchmarkRecorder, map_tensors
from msprobe_engine.dump.free_benchmark_files import NOISE as NOISE_BY_NAME
from msprobe_engine.dump.free_benchmark_files import Compared, tolerance
from msprobe_engine.dump.recorder import RecorderContext
from msprobe_engine.dump.writer import StepData
from msprobe_engine.frameworks.torch.capture.api import ApiCatalog
from msprobe_engine.frameworks.torch.capture.backward import in_backward
from msprobe_engine.stats import empty_rows

HIGHER = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
HIGHER_FLOAT32 = {**HIGHER, torch.float32: torch.float64}  # improve_float32: true
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}
NOISE = {getattr(torch, name): value for name, value in NOISE_BY_NAME.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return map_tensors(value, torch.Tensor, fn)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map(value, lambda t: found.append(t) or t)
    return found


def _random_state(args: tuple) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The random state before a call (CPU, and the CUDA devices of its tensors)."""
    devices = sorted({t.device.index or 0 for t in _tensors_in(args) if t.is_cuda})
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices}


@contextlib.contextmanager
def _same_random(state: tuple[torch.Tensor, dict[int, torch.Tensor]]) -> Iterator[None]:
    """Run a rerun from the random state the original call started from (dropout draws the
    same mask), then put back the state the original call left (training draws on unchanged)."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=list(cuda)):
        torch.set_rng_state(cpu)
        for device, value in cuda.items():
            torch.cuda.set_rng_state(value, device)
        yield


def _target(args: tuple) -> int:
    """The position of the argument the predecessor perturbs (-1: none)."""
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and arg.is_floating_point() and not arg.is_meta:
            return i
        if isinstance(arg, (list, tuple, dict)):
            return i
    return -1


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.numel() > 0 and t.layout == torch.strided


def _add_noise(t: torch.Tensor) -> torch.Tensor:
    if not _floating(t) or t.dtype not in NOISE:
        return t
    noise = NOISE[t.dtype]
    return torch.where(t.abs() > noise ** 0.5, t + noise, t).to(t.dtype)


def _bit_noise(t: torch.Tensor) -> torch.Tensor:
    if not _floating(t) or t.dtype not in BITS:
        return t
    bits = t.contiguous().view(BITS[t.dtype])
    flipped = torch.bitwise_xor(bits, torch.ones_like(bits)).view(t.dtype)
    return torch.where(t.abs() > torch.finfo(t.dtype).smallest_normal, flipped, t)


def _change_value(t: torch.Tensor) -> torch.Tensor:
    if not _floating(t) or t.dim() == 0 or t.size(0) < 2 or (t.dim() > 1 and t.size(1) < 2):
        return t
    out = t.clone()
    first, last = (0, -1) if t.dim() == 1 else ((0, 0), (-1, -1))
    out[first], out[last] = t[last].clone(), t[first].clone()
    return out


def _higher(t: torch.Tensor) -> torch.Tensor:
    return t.to(HIGHER[t.dtype]) if t.dtype in HIGHER else t


def _higher_float32(t: torch.Tensor) -> torch.Tensor:
    return t.to(HIGHER_FLOAT32[t.dtype]) if t.dtype in HIGHER_FLOAT32 else t


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu")


#: pert_mode -> (the tensor perturbation, whether it applies to every input rather than the target)
PERTURBATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "improve_precision": (_higher, True), "to_cpu": (_to_cpu, True), "add_noise": (_add_noise, False),
    "bit_noise": (_bit_noise, False), "change_value": (_change_value, False), "no_change": (lambda t: t, False),
}


def perturb(mode: str, args: tuple, kwargs: dict, index: int, float32: bool = False) -> tuple[tuple, dict]:
    """Perturbed copies of a call's arguments (`float32`: improve_precision raises float32 too)."""
    fn, every = (_higher_float32, True) if float32 and mode == "improve_precision" else PERTURBATIONS[mode]
    if every:
        return _map(args, fn), _map(kwargs, fn)
    return args[:index] + (_map(args[index], fn),) + args[index + 1:], kwargs


def ratio(original: torch.Tensor, perturbed: torch.Tensor, tol: float) -> torch.Tensor:
    """The worst elementwise ratio of two outputs, >= 1 (0-dim, on the device; nan/inf -> 1)."""
    o = original.detach().to(perturbed.dtype).to(perturbed.device).abs()
    p = perturbed.detach().abs()
    r = (o + tol) / (p + tol)
    r = torch.where(torch.maximum(o, p) > tol, torch.maximum(r, 1 / r), torch.ones_like(r))
    worst = r.amax().to(torch.float64)
    return torch.where(torch.isfinite(worst), worst, torch.ones_like(worst))


def _outputs(value: Any) -> list[tuple[int | None, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(None, value)] if _floating(value) else []
    if isinstance(value, (list, tuple)):
        return [(i, v) for i, v in enumerate(value) if isinstance(v, torch.Tensor) and _floating(v)]
    return []


class FreeBenchmark(FreeBenchmarkRecorder):
    """The PyTorch free_benchmark handler of the API mode."""

    def __init__(self, ctx: RecorderContext) -> None:
        super().__init__(ctx, ctx.rank or 0)
        self.catalog: ApiCatalog = ctx.catalog
        self._busy = False

    # ---- the API mode's handler ----------------------------------------------------------
    def api_call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        info = self.catalog.get(func)
        if info is None or not info.dump or not self.active or self._busy or in_backward():
            return func(*args, **kwargs)
        name, wanted = self._call(info.key)
        index = _target(args)
        if (not wanted or index < 0 or info.prefix == "Distributed"
                or info.writes(args, kwargs)):
            return func(*args, **kwargs)
        if self.options.handler_type == "fix":
            fixed = self._guarded(name, self._fixed, func, args, kwargs, index)
            return fixed if fixed is not None else func(*args, **kwargs)
        state = _random_state(args)
        output = func(*args, **kwargs)
        check = self._check_forward if self.options.fuzz_stage == "forward" else self._watch_backward
        self._guarded(name, check, func, args, kwargs, index, name, output, state)
        return output

    def _guarded(self, name: str, body: Callable, *args: Any) -> Any:
        self._busy = True
        try:
            with torch._C.DisableTorchFunction():
                return body(*args)
        except Exception as exc:
            if not self._skip(name, exc):
                raise
            return None
        finally:
            self._busy = False

    def _check_forward(self, func: Callable, args: tuple, kwargs: dict, index: int, name: str, output: Any,
                       state: tuple) -> None:
        p_args, p_kwargs = perturb(self.options.pert_mode, args, kwargs, index, self.options.improve_float32)
        p_args, p_kwargs = _map(p_args, torch.Tensor.detach), _map(p_kwargs, torch.Tensor.detach)
        with _same_random(state), torch.no_grad():
            perturbed = func(*p_args, **p_kwargs)
        self._compare(name, "forward", output, perturbed)

    def _compare(self, name: str, stage: str, original: Any, perturbed: Any) -> None:
        pert = dict(_outputs(perturbed))
        for i, out in _outputs(original):
            if i in pert and pert[i].shape == out.shape:
                dtype = _dtype_name(out.dtype)
                r = ratio(out, pert[i], tolerance(dtype, stage))
                self._pending.append((name, stage, dtype, i, str(out.shape), r))

    def _watch_backward(self, func: Callable, args: tuple, kwargs: dict, index: int, name: str,
                        output: Any, state: tuple) -> None:
        outs = _outputs(output)
        if len(outs) != 1 or not outs[0][1].requires_grad:
            return
        inputs = [t for t in args if isinstance(t, torch.Tensor) and t.requires_grad and _floating(t)]
        if not inputs:
            return
        saved = _map(args, torch.Tensor.detach), _map(kwargs, torch.Tensor.detach)
        outs[0][1].register_hook(partial(self._backward_check, func, saved, index, name, state))

    def _backward_check(self, func: Callable, saved: tuple, index: int, name: str, state: tuple,
                        grad: torch.Tensor) -> None:
        self._guarded(name, self._compare_grads, func, saved, index, name, state, grad)

    def _compare_grads(self, func: Callable, saved: tuple, index: int, name: str, state: tuple,
                       grad: torch.Tensor) -> None:
        args, kwargs = saved
        original = self._input_grads(func, args, kwargs, grad, state)
        p_args, p_kwargs = perturb(self.options.pert_mode, args, kwargs, index, self.options.improve_float32)
        perturbed = self._input_grads(func, p_args, p_kwargs, grad, state)
        for i, (o, p) in enumerate(zip(original, perturbed)):
            if o is not None and p is not None:
                dtype = _dtype_name(o.dtype)
                self._pending.append((name.replace(".forward", ".backward"), "backward", dtype, i if len(original) > 1
                                      else None, str(o.shape), ratio(o, p, tolerance(dtype, "backward"))))

    @staticmethod
    def _input_grads(func: Callable, args: tuple, kwargs: dict, grad: torch.Tensor, state: tuple) -> list:
        leaves = _map(args, lambda t: t.detach().requires_grad_(_floating(t)))
        inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        with torch.enable_grad(), _same_random(state):
            out = _outputs(func(*leaves, **kwargs))[0][1]  # the one floating output (see _watch_backward)
            grads = torch.autograd.grad(out, inputs, grad.to(out.dtype).to(out.device), allow_unused=True)
        return list(grads)

    def _fixed(self, func: Callable, args: tuple, kwargs: dict, index: int) -> Any:
        """fix mode: the call on the more precise inputs, cast back like its first floating input
        (None when it has none: the original call runs)."""
        like = next((t for t in _tensors_in(args) if t.is_floating_point()), None)
        if like is None:
            return None
        p_args, p_kwargs = perturb(self.options.pert_mode, args, kwargs, index, self.options.improve_float32)
        precise = func(*p_args, **p_kwargs)
        return _map(precise, lambda t: t.to(like.device, like.dtype if t.is_floating_point() else t.dtype))

    # ---- step end ---------------------------------------------------------------------------
    def finish_step(self) -> StepData:
        """Read the step's ratios (one host transfer), write the failing outputs."""
        pending, step = self._pending, self._step
        self._step += 1
        self._reset()
        if pending:
            with torch._C.DisableTorchFunction():
                ratios = torch.stack([p[-1].to("cpu") for p in pending]).numpy()
            self.transfers += 1
            self._judge(step, pending, ratios)
        return StepData({}, {}, None, empty_rows(), write_empty=False)

    def _judge(self, step: int, pending: list, ratios: np.ndarray) -> None:
        compared = [Compared(name, stage, dtype, f"torch.{dtype}", shape, index)
                    for name, stage, dtype, index, shape, _ in pending]
        self._submit(step, compared, ratios.tolist())
