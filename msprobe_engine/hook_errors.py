"""The error policy of hook bodies: an error inside the tool never stops the training.

An error raised at a place (`where`) is counted, logged the first time it happens there, and
the place joins `disabled` (hooks check it to switch themselves off); in strict mode
(`strict: true`, the tests) it is re-raised instead. `HookErrors.guard(where)` wraps a hook
body; a hot hook that avoids the context manager's cost calls `failed(where, exc)` from its
own ``except`` clause.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

log = logging.getLogger("msprobe_engine")


class HookErrors:
    """Errors by place, the places switched off, and the warnings given once.

    `label` starts every message (e.g. "msprobe", "msprobe dump"); `step` (optional) says the
    current step for the message; `then` says what happens to the place ("disabled", "skipped")."""

    def __init__(self, strict: bool, *, label: str = "msprobe", step: Callable[[], int] | None = None,
                 then: str = "disabled") -> None:
        self.strict = strict
        self.label = label
        self.then = then
        self._step = step
        #: errors so far, by place
        self.counts: dict[str, int] = {}
        #: the places that failed (not strict): their hooks switch themselves off
        self.disabled: set[str] = set()
        #: the warnings given so far (each is given once)
        self.warned: set[str] = set()

    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Run a hook body: an error goes to `failed(where, error)`."""
        try:
            yield
        except Exception as exc:
            self.failed(where, exc)

    def failed(self, where: str, exc: Exception) -> None:
        """A hook body at `where` raised `exc`: counted, logged once, `where` disabled; strict
        mode re-raises it. Call it from an ``except`` clause."""
        if not self.swallowed(where, exc):
            raise exc

    def swallowed(self, where: str, exc: Exception, what: str | None = None, note: str | None = None) -> bool:
        """`failed` for a caller that re-raises in its own frame: False in strict mode; otherwise
        `exc` is counted under `where`, logged the first time, `where` disabled, and True. `what`
        and `note` replace the logged line's head (``<label>: error in <where> (step N)``) and
        tail (``; it is reported once and <then>``)."""
        if self.strict:
            return False
        count = self.counts.get(where, 0)
        self.counts[where] = count + 1
        self.disabled.add(where)
        if count == 0:
            if what is None:
                at = f" (step {self._step()})" if self._step is not None else ""
                what = f"{self.label}: error in {where}{at}"
            log.error("%s: %s: %s%s", what, type(exc).__name__, exc,
                      f"; it is reported once and {self.then}" if note is None else note)
        return True

    def warn(self, message: str) -> None:
        """Log `message` as a warning, the first time only."""
        if message not in self.warned:
            self.warned.add(message)
            log.warning("%s: %s", self.label, message)
