"""The recorder's call stacks (stack.json), walked only as far as they changed, equal a full walk
of the stack at every call: in loops, nested calls, recursion, and generators resumed from
different callers (whose frames must never end a walk)."""
from __future__ import annotations

import sys

from msprobe_engine.dump.writer import StackNode, as_frames, stack_document
from msprobe_engine.frameworks.torch.capture.call_stack import CallStacks


def _full_walk(frame) -> tuple:
    frames = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(frames)


class Probe:
    def __init__(self) -> None:
        self.stacks = CallStacks()
        self.seen: list[tuple[tuple, tuple]] = []

    def __call__(self) -> StackNode | None:
        node = self.stacks.stack()
        self.seen.append((as_frames(node), _full_walk(sys._getframe(1))))
        return node


def test_every_walk_equals_a_full_walk():
    probe = Probe()

    def leaf():
        probe()
        probe()

    def loop(n):
        for _ in range(n):
            probe()
            leaf()

    def recurse(depth):
        probe()
        if depth:
            recurse(depth - 1)
        probe()

    def gen():
        while True:
            probe()
            yield

    g = gen()

    def resume_here():
        next(g)

    def resume_there():
        next(g)
        probe()

    loop(3)
    recurse(3)
    for _ in range(2):
        resume_here()
        resume_there()
    loop(2)
    assert len(probe.seen) == 3 * 3 + 8 + 4 + 2 + 2 * 3
    for got, wanted in probe.seen:  # the probe's own frame first, then its callers
        assert got[0][2] == "__call__" and got[1:] == wanted


def test_calls_from_the_same_frames_share_their_callers():
    probe = Probe()
    nodes = []

    def loop():
        for _ in range(3):
            nodes.append(probe())

    loop()
    assert nodes[0] is not nodes[1]  # new nodes for the frames that ran on, the callers shared
    assert nodes[0].caller is nodes[1].caller is nodes[2].caller
    probe.stacks.clear()
    assert probe.stacks._known == {}


def test_stack_json_groups_shared_chains_and_lists_as_before():
    outer = StackNode(("a.py", 1, "main"), None)
    first, second = StackNode(("b.py", 2, "f"), outer), StackNode(("b.py", 2, "f"), outer)
    stacks = {"x.0.forward": first, "y.0.forward": second, "z.0.forward": [("b.py", 2, "f"), ("a.py", 1, "main")]}
    document = stack_document(stacks)
    assert list(document) == ["0"] and document["0"][0] == ["x.0.forward", "y.0.forward", "z.0.forward"]
    assert document["0"][1][0].startswith("File b.py, line 2, in f")
    assert stack_document(stacks, legacy=True)["x.0.forward"] == stack_document(stacks, legacy=True)["z.0.forward"]
