"""Online pre-check, training side: every API call's inputs and output go to the checker.

::

    from msprobe_engine.frameworks.torch.precheck.online import OnlinePrecheck

    with OnlinePrecheck(port=8765):          # or host=..., nfs_path=..., config="config.json" (run_ut section)
        train()                              # every API call is copied and queued for the checker

The calls are seen through the same `TorchFunctionMode` as the L1 dump (nothing is patched) and
named like its entries (``Functional.gelu.0``). On the training thread a call costs one
``detach().clone()`` of its tensors; moving them to the host, encoding and sending happen on the
sender thread (`analysis.precheck.client.CheckerClient`), whose bounded queue drops and counts
when the checker falls behind. Calls that cannot be checked (in-place, random, communication,
creation ops) are not sent. The forward is checked with the training's own output against the
float64 benchmark. With `backward` (default), a call whose outputs need gradients is sent when
their gradients arrive (a hook on each output), and the checker compares the input gradients of
the original dtype (run on its `--device`) with float64 ones; calls still waiting are sent at
the next `start` or at `close` (forward only when no gradient came), at most `max_waiting` at
a time (beyond that, forward only at once).
"""
from __future__ import annotations

import io
import logging
import os
import threading
from functools import partial
from pathlib import Path
from typing import Any

import torch

from msprobe_engine.analysis.precheck.cases import ApiCase, selected
from msprobe_engine.analysis.precheck.client import CheckerClient
from msprobe_engine.analysis.precheck.runner import load_precheck_config
from msprobe_engine.analysis.precheck.transport import DirectoryTransport, TcpTransport
from msprobe_engine.dump.entry import UNHANDLED, describe
from msprobe_engine.frameworks.torch.capture.api import ApiCatalog, ApiMode, push_mode, remove_mode
from msprobe_engine.frameworks.torch.precheck.replay import tensors_of

log = logging.getLogger("msprobe_engine")


def _leaf(value: Any, name: str) -> Any:
    if isinstance(value, torch.Tensor):  # a copy that says whether the original required grad
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, torch.Size):
        return {"type": "torch.Size", "value": list(value)}
    if isinstance(value, (torch.dtype, torch.device)):
        return {"type": f"torch.{type(value).__name__}", "value": str(value)}
    return UNHANDLED


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, list):
        return [_to_host(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    return value


def encode_case(case: ApiCase) -> bytes:
    """One call as bytes (``torch.save`` of its name and entries, tensors on the host)."""
    buffer = io.BytesIO()
    torch.save({"name": case.name, "api": case.api, "forward": _to_host(case.forward),
                "backward": _to_host(case.backward)}, buffer)
    return buffer.getvalue()


def decode_case(payload: bytes) -> ApiCase:
    """The call `encode_case` wrote (read with ``weights_only=True``: tensors and plain values only)."""
    doc = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    return ApiCase(doc["name"], doc["api"], doc["forward"], doc.get("backward"))


class _AwaitingGrads:
    """A call sent once the gradients of its differentiable outputs have arrived (`grads` in
    the order of those outputs); the copies of the outputs give the zeros of unused ones."""

    def __init__(self, case: ApiCase, copies: list[torch.Tensor]) -> None:
        self.case, self.copies = case, copies
        self.grads: list[torch.Tensor | None] = [None] * len(copies)

    def complete(self) -> ApiCase:
        """The case with the gradients that arrived (zeros for the others); forward only if none did."""
        if any(g is not None for g in self.grads):
            grads = [g if g is not None else torch.zeros_like(c, requires_grad=False)
                     for g, c in zip(self.grads, self.copies)]
            self.case.backward = {"input": grads}
        return self.case


class OnlinePrecheck:
    """Sends the API calls made between `start` and `stop` to the checker at `host:port`."""

    def __init__(self, host: str | None = None, port: int | None = None, *, config: str | Path | None = None,
                 nfs_path: str | Path | None = None, queue_size: int = 64, tls_ca: str | None = None,
                 white_list: tuple[str, ...] | None = None, black_list: tuple[str, ...] | None = None,
                 backward: bool = True, max_waiting: int = 1024) -> None:
        """The checker at `host:port`, or the directory `nfs_path` it watches; unset ones come from
        the ``run_ut`` section of `config` (the predecessor's keys)."""
        settings = load_precheck_config(config)
        nfs_path = nfs_path or settings.nfs_path
        host, port = host or settings.host, port if port is not None else settings.port
        if nfs_path:
            transport: TcpTransport | DirectoryTransport = DirectoryTransport(nfs_path)
        elif port:
            transport = TcpTransport(host, port, tls_ca)
        else:
            raise ValueError("online run_ut: give the checker's port (port=..., or run_ut.port in the config) "
                             "or its directory (nfs_path=...)")
        self.white_list = settings.white_list if white_list is None else white_list
        self.black_list = settings.black_list if black_list is None else black_list
        rank = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None
        self.client = CheckerClient(transport, "torch", encode_case, rank=rank, queue_size=queue_size)
        self._catalog = ApiCatalog()
        self._mode = ApiMode(self._call)
        self._counters: dict[str, int] = {}
        self._active = False
        self.errors = 0
        self.backward, self.max_waiting = backward, max_waiting
        self._waiting: dict[int, _AwaitingGrads] = {}
        self._lock = threading.Lock()  # `_waiting`: gradient hooks may run on autograd's threads

    def start(self) -> "OnlinePrecheck":
        self._send_waiting()
        if not self._active:
            self._active = True
            push_mode(self._mode)
        return self

    def stop(self) -> None:
        if self._active:
            self._active = False
            remove_mode(self._mode)

    def close(self, timeout: float = 60.0) -> None:
        """Stop, send what is queued and close the connection."""
        self.stop()
        self._send_waiting()
        self.client.close(timeout)

    def __enter__(self) -> "OnlinePrecheck":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        try:
            self._capture(func, args, kwargs, out)
        except Exception as e:  # never into the training: reported once, the call goes unchecked
            self.errors += 1
            if self.errors == 1:
                log.error("msprobe run_ut online: cannot capture %s: %s: %s; such calls are skipped",
                          getattr(func, "__name__", func), type(e).__name__, e)
        return out

    def _capture(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Queue one call for the checker, unless it is not checked (see the module docstring)."""
        info = self._catalog.get(func)
        if info is None or not info.dump or not selected(info.key, self.white_list, self.black_list):
            return
        n = self._counters.get(info.key, 0)
        self._counters[info.key] = n + 1
        name = f"{info.key}.{n}"
        probe = ApiCase(name, info.key, {})
        if probe.inplace or info.writes(args, kwargs) or probe.skip_reason():
            return
        if not self.client.alive:  # no checker: count it, copy nothing
            self.client.submit(None)
            return
        kwargs = info.user_kwargs(kwargs)
        entry = {"input_args": describe(list(args), f"{name}.forward.input", _leaf),
                 "input_kwargs": describe(dict(kwargs), f"{name}.forward.input", _leaf),
                 "output": describe(out, f"{name}.forward.output", _leaf)}
        case = ApiCase(name, info.key, entry)
        outputs = [t for t in tensors_of(out) if t.requires_grad] if self.backward and torch.is_grad_enabled() else []
        with self._lock:
            wait = bool(outputs) and len(self._waiting) < self.max_waiting
            if wait:
                copies = [t for t in tensors_of(entry["output"]) if t.requires_grad]
                self._waiting[id(case)] = _AwaitingGrads(case, copies)
        if not wait:
            self.client.submit(case)
            return
        for i, t in enumerate(outputs):
            t.register_hook(partial(self._on_grad, id(case), i))

    def _on_grad(self, key: int, index: int, grad: torch.Tensor) -> None:
        """A gradient hook: keep a copy; the call goes once every output's gradient is in."""
        with self._lock:
            waiting = self._waiting.get(key)
            if waiting is None:
                return
            waiting.grads[index] = grad.detach().clone()
            done = all(g is not None for g in waiting.grads)
            if done:
                del self._waiting[key]
        if done:
            self.client.submit(waiting.complete())

    def _send_waiting(self) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for call in waiting:
            self.client.submit(call.complete())
