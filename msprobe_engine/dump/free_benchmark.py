"""free_benchmark's recorder, framework-neutral part: call names and selection, the verdicts, the
error policy (per API), the hand-over of failing outputs to the writer thread. A framework's
recorder intercepts the API calls, perturbs and compares (PyTorch:
`frameworks.torch.capture.free_benchmark`, MindSpore: `frameworks.mindspore.capture.free_benchmark`)."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

from msprobe_engine.dump.free_benchmark_files import Compared, Judge, ResultRow, write_results
from msprobe_engine.dump.recorder import DumpRecorder, RecorderContext
from msprobe_engine.dump.select import Selection


def map_tensors(value: Any, tensor_type: type, fn: Callable[[Any], Any]) -> Any:
    """`value` with every `tensor_type` in it (also inside lists, tuples and dicts) replaced by `fn(tensor)`."""
    if isinstance(value, tensor_type):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, tensor_type, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, tensor_type, fn) for k, v in value.items()}
    return value


class FreeBenchmarkRecorder(DumpRecorder):
    """The free_benchmark task's handler of API calls (the session's `_recorder`); `judge_rank`:
    what the results' rank column shows."""

    watches_model = True  # it perturbs APIs (level L1): the model needs no module hooks

    def __init__(self, ctx: RecorderContext, judge_rank: int | None) -> None:
        super().__init__(ctx)
        self.rank, self.writer = ctx.rank, ctx.writer
        self.sel = Selection(ctx.config)
        self.judge = Judge(self.options, judge_rank)
        self._step = 0
        self._reset()

    def _reset(self) -> None:
        self._counters: dict[str, int] = {}
        self._pending: list = []
        self.sel.new_step()

    @property
    def failed(self) -> list[ResultRow]:
        """Every failing output so far (also written to the CSV)."""
        return self.judge.failed

    @property
    def compared(self) -> int:
        """Outputs compared so far."""
        return self.judge.compared

    @property
    def results(self) -> list:
        return self.failed

    def _call(self, key: str) -> tuple[str, bool]:
        """(the dump name of this call of `key`, whether its forward is selected): every call counts,
        as in the dump, so names are the dump's."""
        n = self._counters.get(key, 0)
        self._counters[key] = n + 1
        name = f"{key}.{n}.forward"
        want = self.sel.want(key, name, f"{key}.{n}.backward")
        in_scope = self.sel.begin(name)
        self.sel.end(name)
        return name, want.forward and in_scope

    def _skip(self, name: str, exc: Exception) -> bool:
        """A call that could not be checked: counted and logged once per API (strict: False, re-raise)."""
        return self.skipped(name.rsplit(".", 2)[0], exc, f"msprobe free_benchmark: {name} skipped",
                            " (reported once per API)")

    def _submit(self, step: int, compared: Sequence[Compared], ratios: list[float], *header: Any) -> None:
        """Judge the step's ratios; the failing outputs go to the writer thread."""
        rows = self.judge.rows(step, list(compared), ratios)
        if rows:
            self.writer.submit(partial(write_results, self.config.dump_path, step, self.rank, rows, *header),
                               "free_benchmark results", wait=True)
