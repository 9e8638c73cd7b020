"""The built-in dump tasks: the predecessor's tasks, each a registered `DumpTask` with its Config.

=================  =====================================================================  ==========
task               section keys (defaults)                                                levels
=================  =====================================================================  ==========
statistics         scope/list/data_mode/summary_mode                                      L0, L1, mix
tensor             scope/list/data_mode/summary_mode (tensor files too)                   L0, L1, mix
overflow_check     ``overflow_nums`` (1; -1 all), ``check_mode`` ("all"), scope/list     L0, L1
grad_probe         ``grad_level`` ("L1"), ``param_list`` ([]), ``bounds`` ([-1, 0, 1])    (none)
free_benchmark     ``pert_mode``, ``handler_type``, ``fuzz_level``, ``fuzz_stage``,       L1
                   ``fuzz_device``, ``if_preheat``, ``preheat_step``, ``max_sample``,
                   ``improve_float32`` (false; ours), scope/list
diff_check         ``bench_path`` (required), ``diff_nums`` (1; -1 all), ``rtol``,        L0, L1, mix
                   ``atol``, scope/list/data_mode/summary_mode
=================  =====================================================================  ==========

``diff_check`` is the live compare against a reference dump (the predecessor's ``bench_path``
and ``diff_nums``). A problem raises `ConfigError` naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msprobe_engine.errors import ConfigError
from msprobe_engine.fields import choices
from msprobe_engine.dump import checks
from msprobe_engine.dump.checks import checked
from msprobe_engine.dump.task import DumpTask, FullSelection, ScopeList, ScopeListMode, register_task

PERT_MODES = ("improve_precision", "add_noise", "bit_noise", "change_value", "no_change", "to_cpu")
HANDLER_TYPES = ("check", "fix")
FIX_PERT_MODES = ("improve_precision", "to_cpu")
FUZZ_STAGES = ("forward", "backward")
FUZZ_DEVICES = ("npu", "cpu")
GRAD_LEVELS = ("L0", "L1", "L2")


@register_task("statistics")
class Statistics(DumpTask):
    """Every selected call's tensors as statistics (Max, Min, Mean, Norm) in dump.json."""

    @dataclass(kw_only=True, slots=True)
    class Config(FullSelection):
        pass


@register_task("tensor")
class TensorTask(DumpTask):
    """As statistics, and every tensor saved as a file."""
    saves_tensors = True

    @dataclass(kw_only=True, slots=True)
    class Config(FullSelection):
        pass


def _check_mode(value: Any, path: str) -> str:
    if value in ("aicore", "atomic"):
        raise ConfigError(f"{path}: {value!r} checks kernels of a MindSpore static graph (level L2), "
                          "which this tool does not capture; use \"all\"")
    if value != "all":
        raise ConfigError(f"{path}: {value!r} is not one of all, aicore, atomic")
    return value


@register_task("overflow_check")
class OverflowCheck(DumpTask):
    """Dump the first `overflow_nums` calls of a step whose outputs hold nan/inf."""
    levels = ("L0", "L1")
    saves_tensors = True

    @dataclass(kw_only=True, slots=True)
    class Config(ScopeListMode):
        overflow_nums: int = field(default=1, metadata=checked(checks.count()))  # -1: every overflowing call
        check_mode: str = field(default="all", metadata=checked(_check_mode))


@register_task("grad_probe")
class GradProbe(DumpTask):
    """Per-parameter gradient statistics and directions at every optimizer step."""
    levels = None

    @dataclass(kw_only=True, slots=True)
    class Config:
        grad_level: str = field(default="L1", metadata=choices(*GRAD_LEVELS))
        param_list: tuple[str, ...] = field(default=(), metadata=checked(checks.names))
        bounds: tuple[float, ...] = field(default=(-1, 0, 1), metadata=checked(checks.bounds))


@register_task("free_benchmark")
class FreeBenchmark(DumpTask):
    """Run selected APIs again on perturbed inputs and compare (or substitute)."""
    levels = ("L1",)

    @dataclass(kw_only=True, slots=True)
    class Config(ScopeList):
        pert_mode: str = field(default="improve_precision", metadata=choices(*PERT_MODES))
        handler_type: str = field(default="check", metadata=choices(*HANDLER_TYPES))
        fuzz_level: str = field(default="L1", metadata=choices("L1"))
        fuzz_stage: str = field(default="forward", metadata=choices(*FUZZ_STAGES))
        fuzz_device: str = field(default="npu", metadata=choices(*FUZZ_DEVICES))
        if_preheat: bool = field(default=False, metadata=checked(checks.loose_flag))
        preheat_step: int = field(default=15, metadata=checked(checks.count(allow_all=False)))
        max_sample: int = field(default=20, metadata=checked(checks.count(allow_all=False)))
        #: improve_precision raises float32 to float64 too (ours); false: float32 is left alone, as in the predecessor
        improve_float32: bool = field(default=False, metadata=checked(checks.flag))

    @classmethod
    def check(cls, options: Any, given: set[str]) -> None:
        if options.handler_type == "fix":
            if options.pert_mode not in FIX_PERT_MODES:
                raise ConfigError(f"pert_mode: {options.pert_mode!r} cannot fix outputs; handler_type \"fix\" needs "
                                  f"one of {', '.join(FIX_PERT_MODES)}")
            if options.fuzz_stage != "forward":
                raise ConfigError("fuzz_stage: handler_type \"fix\" substitutes forward outputs only; use \"forward\"")
            if options.if_preheat:
                raise ConfigError("if_preheat: preheating is a check-mode feature; set it false with handler_type "
                                  "\"fix\"")
        if (options.fuzz_device == "cpu") != (options.pert_mode == "to_cpu"):
            raise ConfigError(f"fuzz_device: {options.fuzz_device!r} with pert_mode {options.pert_mode!r}: "
                              "\"cpu\" goes with \"to_cpu\" and only with it")
        # the predecessor's own example writes "if_preheat": false beside preheat_step/max_sample: inert then
        if "if_preheat" not in given and ("preheat_step" in given or "max_sample" in given):
            raise ConfigError("preheat_step/max_sample: need \"if_preheat\": true")


@register_task("diff_check")
class DiffCheck(DumpTask):
    """Compare each call with a reference dump while training; dump the first divergent ones."""
    saves_tensors = True

    @dataclass(kw_only=True, slots=True)
    class Config(FullSelection):
        bench_path: Path = field(metadata=checked(checks.directory))
        diff_nums: int = field(default=1, metadata=checked(checks.count()))  # -1: every divergent call
        rtol: float = field(default=1e-3, metadata=checked(checks.tolerance))
        atol: float = field(default=1e-6, metadata=checked(checks.tolerance))
