"""The MindSpore recorders' common part: API routes open only while recording, and hook bodies
whose own MindSpore calls are not routed."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from msprobe_engine.dump.recorder import DumpRecorder, RecorderContext
from msprobe_engine.frameworks.mindspore.capture.apis import Gate


class GatedRecorder(DumpRecorder):
    """A MindSpore recorder behind a `Gate`: `routes_apis` says whether API calls reach it."""

    def __init__(self, ctx: RecorderContext) -> None:
        self.gate = Gate()
        self._active = False
        super().__init__(ctx)

    @property
    def routes_apis(self) -> bool:
        return True

    @property
    def active(self) -> bool:
        """Recording now (switched by the session's start/stop); API calls are routed only then."""
        return self._active

    @active.setter
    def active(self, value: bool) -> None:
        self._active = value
        self.gate.open = value and self.routes_apis

    @contextlib.contextmanager
    def _gated(self, swallowed: Callable[[Exception], bool]) -> Iterator[None]:
        """A hook body: its own MindSpore calls are not routed (the gate is closed meanwhile); an
        error is skipped when `swallowed(exc)` says so (the error policy), else raised."""
        routed, self.gate.open = self.gate.open, False
        try:
            yield
        except Exception as exc:
            if not swallowed(exc):
                raise
        finally:
            self.gate.open = routed
