"""diff_check for PyTorch: each step's calls compared with a reference dump while training.

Calls are recorded and held as in `held.HeldTensorsRecorder`; at step end, after the one
host transfer of statistics, the step's records are compared with the reference's same
step (`msprobe_engine.dump.live_compare`); the first ``diff_nums`` divergent calls are
written with their real tensors, plus ``diff_summary.json`` naming the first divergent call
and why. With ``summary_mode: md5`` the held copies are checksummed at step end (one host
copy per tensor) and CRC-32 values are compared exactly.
"""
from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from msprobe_engine.dump.entry import render_entries
from msprobe_engine.dump.live_compare import SUMMARY_JSON, Reference, divergent
from msprobe_engine.dump.writer import StepData
from msprobe_engine.frameworks.torch.capture.held import HeldTensorsRecorder
from msprobe_engine.frameworks.torch.capture.recorder import tensor_crc32

log = logging.getLogger("msprobe_engine")


class LiveCompareRecorder(HeldTensorsRecorder):
    """The dump's recorder for ``task: diff_check``; `divergences` lists (step, first divergent call)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reference = Reference(self.config.options.bench_path)
        self.divergences: list[tuple[int, str]] = []
        self._missing_warned = False

    @property
    def results(self) -> list:
        return self.divergences

    def choose(self, step: int, data: StepData, held: list) -> tuple[list[str], dict[str, Any] | None]:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
        reference = self.reference.entries(step, rank)
        if reference is None:
            if not self._missing_warned:
                self._missing_warned = True
                log.warning("msprobe diff_check: the reference has no step %d (rank %s; it has steps %s); "
                            "such steps are not compared", step, rank, self.reference.steps)
            return [], None
        if self.config.summary_mode == "md5":
            for slot, clone, _ in held:
                slot.md5 = tensor_crc32(clone.to("cpu"))
        opts = self.config.options
        found = divergent(render_entries(data.entries, data.host_rows), reference, opts.rtol, opts.atol,
                          opts.diff_nums)
        if not found:
            return [], None
        first = found[0]
        self.divergences.append((step, first.name))
        log.warning("msprobe diff_check: step %d: first divergent call %s (%s)", step, first.name, first.reason)
        return [d.name for d in found], {SUMMARY_JSON: {"step": step, "first_divergent": first.name,
                                                        "reason": first.reason, "diff_nums": opts.diff_nums,
                                                        "divergent": [d.as_dict() for d in found]}}
