"""Backward gradients of one call (a module forward or an API) without wrapping its tensors.

For each call the dump wants two lists: the gradient arriving at each output (``input`` of
the backward entry) and the gradient each input receives *through this call* (``output``).
`register_full_backward_hook` gets them by passing inputs and outputs through an identity
autograd Function, which makes any later in-place op on them an error ("Output 0 of
BackwardHookFunction is a view and is being modified inplace"). Here nothing is replaced:

- output gradients come from tensor hooks on the outputs;
- before the call, the gradient edges of the inputs are noted together with the autograd
  sequence number; after it, the nodes the call created (sequence numbers in that window)
  are walked from the outputs, and a hook goes on every node edge that points at an input.
  The gradients on those edges, summed per input, are what flows into it through this call;
- an output the call itself read again (``return y, y * 3``; a module's last hidden state read
  by its own pooler) gets, on its tensor hook, the gradient of those reads as well: the reads'
  edges are hooked the same way and their sum is taken off, leaving what arrives at the call's
  boundary from outside, as torch's full backward hook gives it (None when the gradient is the
  very tensor the call's one read sent: nothing came from outside).

Hooks return None: gradients and training numbers are untouched.

A module whose output is written in place, later (``h = block(x); h += residual``, marked by
`Rewrites`) or within the call (``nn.ReLU(inplace=True)`` returns its input, written), gets no
backward entry, as under torch's full backward hook, which the predecessor uses (its hook on
that output does not fire).
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Iterable, Sequence

import torch
from torch.autograd.graph import get_gradient_edge

from msprobe_engine.frameworks.torch.module_hooks import in_backward

__all__ = ["CallEdges", "GradCall", "Rewrites", "after_call", "before_call", "in_backward", "sequence_nr"]

_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)


def sequence_nr() -> int | None:
    """The sequence number the next autograd node of this thread gets (None: not in this torch)."""
    return _sequence_nr() if _sequence_nr is not None else None
#: most autograd nodes walked for one call (a guard against walking a foreign graph)
MAX_NODES = 50_000

Done = Callable[["GradCall"], None]


class CallEdges:
    """What is noted before a call: the input edges and the autograd sequence number."""
    __slots__ = ("start", "edges", "count", "versions", "integral")

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        self.start = _sequence_nr() if _sequence_nr is not None else None
        self.count = len(inputs)
        self.edges: dict[tuple, list[int]] = {}
        #: id -> version of each input, to tell an input returned after being written in place
        self.versions = {id(t): t._version for t in inputs}
        #: positions of integer and bool inputs: no gradient, no place in the backward entry
        self.integral = frozenset(i for i, t in enumerate(inputs) if not (t.is_floating_point() or t.is_complex()))
        for i, tensor in enumerate(inputs):
            if tensor.requires_grad:
                edge = get_gradient_edge(tensor)
                # a tensor given twice (attn(x, x, x)): its gradient cannot be split by position;
                # the whole of it goes to its first position, the others get none
                self.edges.setdefault((edge.node, edge.output_nr), [i])


def before_call(inputs: Sequence[torch.Tensor]) -> CallEdges | None:
    """Note the inputs' gradient edges, or None when no graph is being recorded."""
    return CallEdges(inputs) if torch.is_grad_enabled() else None


class GradCall:
    """The backward gradients of one call, filled by hooks; `done(self)` runs once all arrived."""

    def __init__(self, tag: object, n_outputs: int, n_inputs: int, done: Done) -> None:
        self.tag = tag
        self.output_grads: list[torch.Tensor | None] = [None] * n_outputs
        #: per output, the gradient the call's own later reads of it sent back (None: no read)
        self.read_grads: list[torch.Tensor | None] = [None] * n_outputs
        self.input_grads: list[torch.Tensor | None] = [None] * n_inputs
        self.expected = 0
        self.finished = False
        #: an output was written in place after the call returned (see `Rewrites`)
        self.rewritten = False
        #: input positions that take no gradient (integer inputs), left out of `sent_grads`
        self.integral: frozenset[int] = frozenset()
        self._done = done
        self._handles: list = []
        #: (weak reference, version) of each output (`note_versions`), where no API mode sees writes
        self._versions: list[tuple[weakref.ref, int]] = []
        self._lock = threading.Lock()

    def note_versions(self, outputs: Iterable[torch.Tensor]) -> None:
        """Keep the outputs' versions, for `check_versions`."""
        self._versions = [(weakref.ref(t), t._version) for t in outputs]

    def check_versions(self) -> None:
        """Mark the call `rewritten` when an output still alive was written in place since `note_versions`."""
        for ref, seen in self._versions:
            tensor = ref()
            if tensor is not None and tensor._version != seen:
                self.rewritten = True
        self._versions = []

    def sent_grads(self) -> list[torch.Tensor | None]:
        """The gradient sent to each input that can take one (integer inputs left out, as in
        the predecessor's module backward entries: MixtralExperts' routing weights follow
        the hidden states, not a null for the expert indices)."""
        return [g for i, g in enumerate(self.input_grads) if i not in self.integral]

    def _arrived(self) -> None:
        self.expected -= 1
        if self.expected == 0:
            self.finish()

    def _add_input(self, slot: int, grad: torch.Tensor | None) -> None:
        self.input_grads[slot] = _plus(self.input_grads[slot], grad)

    def output_hook(self, index: int, feeds: Sequence[int]):
        def hook(grad: torch.Tensor) -> None:
            with self._lock:
                if self.finished:
                    return
                read = self.read_grads[index]  # the call's own reads ran first: they come later in the graph
                if read is not None:
                    # the very tensor a read sent: nothing arrived from outside (None, as torch's hook gives)
                    grad = None if grad is read else grad - read
                self.output_grads[index] = grad
                for slot in feeds:  # the output is an input returned as it is
                    self._add_input(slot, grad)
                self._arrived()
        return hook

    def node_hook(self, targets: list[tuple[int, list[int]]], reads: list[tuple[int, list[int]]]):
        """A hook on one of the call's nodes: `targets` (edge index, input slots) feed inputs,
        `reads` (edge index, output positions) are the call's own reads of its outputs."""
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            with self._lock:
                if self.finished:
                    return
                for index, slots in targets:
                    for slot in slots:
                        self._add_input(slot, grad_inputs[index])
                for index, positions in reads:
                    for position in positions:
                        self.read_grads[position] = _plus(self.read_grads[position], grad_inputs[index])
                self._arrived()
        return hook

    def finish(self) -> None:
        """Hand over what arrived (also called for calls whose backward never completed)."""
        if self.finished:
            return
        self.finished = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._done(self)


def after_call(edges: CallEdges, outputs: Sequence[torch.Tensor], tag: object, done: Done) -> GradCall | None:
    """Hook the outputs and the call's own autograd nodes; None when no output needs a gradient."""
    wanted = [(i, t) for i, t in enumerate(outputs) if t.requires_grad]
    if not wanted:
        return None
    call = GradCall(tag, len(outputs), edges.count, done)
    call.rewritten = any(edges.versions.get(id(t), t._version) != t._version for t in outputs)
    call.integral = edges.integral
    produced: dict[tuple, list[int]] = {}  # output edge -> its positions
    for index, tensor in wanted:
        edge = get_gradient_edge(tensor)
        produced.setdefault((edge.node, edge.output_nr), []).append(index)
        feeds = edges.edges.get((edge.node, edge.output_nr), [])
        call._handles.append(tensor.register_hook(call.output_hook(index, feeds)))
    if edges.start is not None:
        end = _sequence_nr()
        for node, (targets, reads) in _call_edges(edges, produced, [t.grad_fn for _, t in wanted], end).items():
            call._handles.append(node.register_hook(call.node_hook(targets, reads)))
    call.expected = len(call._handles)
    return call


def _call_edges(edges: CallEdges, produced: dict[tuple, list[int]], roots: list, end: int) -> dict:
    """Nodes created by the call (sequence number in [start, end)) with edges to its inputs or
    to its outputs: node -> ([(edge index, input slots)], [(edge index, output positions)])."""
    found: dict = {}
    seen = {id(r) for r in roots if r is not None}
    stack = [r for r in roots if r is not None]
    while stack and len(seen) < MAX_NODES:
        node = stack.pop()
        if not edges.start <= node._sequence_nr() < end:
            continue  # older than the call: not part of it
        for index, (child, output_nr) in enumerate(node.next_functions):
            if child is None:
                continue
            positions = produced.get((child, output_nr))
            if positions is not None:
                found.setdefault(node, ([], []))[1].append((index, positions))
            slots = edges.edges.get((child, output_nr))
            if slots is not None:
                found.setdefault(node, ([], []))[0].append((index, slots))
            elif id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return found


def _plus(total: torch.Tensor | None, grad: torch.Tensor | None) -> torch.Tensor | None:
    """`total` + `grad`, either of them None (no gradient yet, none on that edge)."""
    if grad is None:
        return total
    return grad if total is None else total + grad


class Rewrites:
    """The outputs of the calls being watched, to mark a call whose output a later in-place
    call writes into (`GradCall.rewritten`). Tensors are held weakly; the recorder makes a new
    one every step."""

    def __init__(self) -> None:
        self._watched: dict[int, tuple[weakref.ref, list[GradCall]]] = {}

    def watch(self, outputs: Iterable[torch.Tensor], call: GradCall) -> None:
        for tensor in outputs:
            known = self._watched.get(id(tensor))
            if known is None or known[0]() is not tensor:
                known = self._watched[id(tensor)] = (weakref.ref(tensor), [])
            known[1].append(call)

    def written(self, tensors: Iterable[torch.Tensor]) -> bool:
        """`tensors` are about to be written in place; whether one of them is a watched output."""
        hit = False
        for tensor in tensors:
            known = self._watched.get(id(tensor))
            if known is not None and known[0]() is tensor:
                hit = True
                for call in known[1]:
                    call.rewritten = True
        return hit
