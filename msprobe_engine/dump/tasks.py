"""The predecessor's other debugger tasks: their config sections, validated at load (framework-neutral).

=================  =====================================================================  ==========
task               section keys (defaults)                                                levels
=================  =====================================================================  ==========
overflow_check     ``overflow_nums`` (1; -1 all), ``check_mode`` ("all"), scope/list     L0, L1
grad_probe         ``grad_level`` ("L1"), ``param_list`` ([]), ``bounds`` ([-1, 0, 1])    (none)
free_benchmark     ``pert_mode``, ``handler_type``, ``fuzz_level``, ``fuzz_stage``,       L1
                   ``fuzz_device``, ``if_preheat``, ``preheat_step``, ``max_sample``,
                   ``improve_float32`` (false; ours), scope/list
diff_check         ``bench_path`` (required), ``diff_nums`` (1; -1 all), ``rtol``,        L0, L1, mix
                   ``atol``, scope/list/data_mode
=================  =====================================================================  ==========

``diff_check`` is the live compare against a reference dump (the predecessor's ``bench_path``
and ``diff_nums``). Every problem raises `ConfigError` naming the key; `require_support`
is a framework session's check that it implements the task (before training).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msprobe_engine.config.errors import ConfigError

#: tasks configured in this module, and the levels each accepts (None: the key is not used)
TASK_LEVELS: dict[str, tuple[str, ...] | None] = {
    "overflow_check": ("L0", "L1"),
    "grad_probe": None,
    "free_benchmark": ("L1",),
    "diff_check": ("L0", "L1", "mix"),
}
#: the shared selection keys (scope, list, data_mode) each task's section also accepts
SELECTION_KEYS: dict[str, tuple[str, ...]] = {
    "overflow_check": ("scope", "list", "data_mode"),
    "grad_probe": (),
    "free_benchmark": ("scope", "list"),
    "diff_check": ("scope", "list", "data_mode", "summary_mode"),
}
PERT_MODES = ("improve_precision", "add_noise", "bit_noise", "change_value", "no_change", "to_cpu")
HANDLER_TYPES = ("check", "fix")
FIX_PERT_MODES = ("improve_precision", "to_cpu")
FUZZ_STAGES = ("forward", "backward")
FUZZ_DEVICES = ("npu", "cpu")
GRAD_LEVELS = ("L0", "L1", "L2")
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1


@dataclass(frozen=True)
class OverflowCheckOptions:
    """overflow_check: dump the first `overflow_nums` calls of a step whose outputs hold nan/inf."""
    overflow_nums: int = 1      # -1: every overflowing call
    check_mode: str = "all"


@dataclass(frozen=True)
class GradProbeOptions:
    """grad_probe: per-parameter gradient statistics and directions at every optimizer step."""
    grad_level: str = "L1"
    param_list: tuple[str, ...] = ()
    bounds: tuple[float, ...] = (-1, 0, 1)


@dataclass(frozen=True)
class FreeBenchmarkOptions:
    """free_benchmark: run selected APIs again on perturbed inputs and compare (or substitute)."""
    pert_mode: str = "improve_precision"
    handler_type: str = "check"
    fuzz_level: str = "L1"
    fuzz_stage: str = "forward"
    fuzz_device: str = "npu"
    if_preheat: bool = False
    preheat_step: int = 15
    max_sample: int = 20
    #: improve_precision raises float32 to float64 too (ours); false: float32 is left alone, as in the predecessor
    improve_float32: bool = False


@dataclass(frozen=True)
class DiffCheckOptions:
    """diff_check: compare each call with a reference dump while training; dump the first divergent ones."""
    bench_path: Path
    diff_nums: int = 1          # -1: every divergent call
    rtol: float = 1e-3
    atol: float = 1e-6


TaskOptions = OverflowCheckOptions | GradProbeOptions | FreeBenchmarkOptions | DiffCheckOptions


def section_keys(task: str) -> tuple[str, ...]:
    """Every key the section of `task` accepts."""
    return SELECTION_KEYS[task] + _PARSERS[task][1]


def parse_task_options(task: str, section: dict, level: str, level_given: bool) -> TaskOptions:
    """The options of `task` from its section (already checked for unknown keys)."""
    allowed = TASK_LEVELS[task]
    if allowed is not None and level not in allowed:
        where = "" if level_given else " (the default)"
        raise ConfigError(f"level: {level!r}{where} is not supported by task {task}; use one of {', '.join(allowed)}")
    parse, _ = _PARSERS[task]
    try:
        return parse(section)
    except ConfigError as exc:
        raise ConfigError(f"{task}.{exc}") from None


def require_support(task: str, framework: str, supported: tuple[str, ...]) -> None:
    """A framework session's check, before training, that it implements `task`."""
    if task not in supported:
        raise ConfigError(f"task: {task!r} is not supported on {framework} yet; "
                          f"{framework} supports {', '.join(supported)}")


# ---- one parser per task ----------------------------------------------------------------
def _overflow(section: dict) -> OverflowCheckOptions:
    mode = section.get("check_mode", "all")
    if mode in ("aicore", "atomic"):
        raise ConfigError(f"check_mode: {mode!r} checks kernels of a MindSpore static graph (level L2), "
                          "which this tool does not capture; use \"all\"")
    if mode != "all":
        raise ConfigError(f"check_mode: {mode!r} is not one of all, aicore, atomic")
    return OverflowCheckOptions(overflow_nums=_count(section.get("overflow_nums", 1), "overflow_nums"),
                                check_mode=mode)


def _grad_probe(section: dict) -> GradProbeOptions:
    level = section.get("grad_level", "L1")
    if level not in GRAD_LEVELS:
        raise ConfigError(f"grad_level: {level!r} is not one of {', '.join(GRAD_LEVELS)}")
    params = section.get("param_list", [])
    if not isinstance(params, list) or not all(isinstance(p, str) and p for p in params):
        raise ConfigError(f"param_list: expected a list of parameter names, got {params!r}")
    return GradProbeOptions(grad_level=level, param_list=tuple(params),
                            bounds=_bounds(section.get("bounds", [-1, 0, 1])))


def _bounds(value: Any) -> tuple[float, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"bounds: expected a non-empty ascending list of numbers, got {value!r}")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item):
            raise ConfigError(f"bounds[{i}]: {item!r} is not a finite number")
        if not INT64_MIN <= item <= INT64_MAX:
            raise ConfigError(f"bounds[{i}]: {item!r} is outside the int64 range")
        if i and item <= value[i - 1]:
            raise ConfigError(f"bounds[{i}]: {item!r} is not greater than bounds[{i - 1}] = {value[i - 1]!r}; "
                              "bounds must be strictly ascending")
    return tuple(value)


def _free_benchmark(section: dict) -> FreeBenchmarkOptions:
    opts = FreeBenchmarkOptions(
        pert_mode=_one_of(section, "pert_mode", PERT_MODES, "improve_precision"),
        handler_type=_one_of(section, "handler_type", HANDLER_TYPES, "check"),
        fuzz_level=_one_of(section, "fuzz_level", ("L1",), "L1"),
        fuzz_stage=_one_of(section, "fuzz_stage", FUZZ_STAGES, "forward"),
        fuzz_device=_one_of(section, "fuzz_device", FUZZ_DEVICES, "npu"),
        if_preheat=_flag(section.get("if_preheat", False), "if_preheat"),
        preheat_step=_count(section.get("preheat_step", 15), "preheat_step", allow_all=False),
        max_sample=_count(section.get("max_sample", 20), "max_sample", allow_all=False),
        improve_float32=_flag(section.get("improve_float32", False), "improve_float32"),
    )
    if opts.handler_type == "fix":
        if opts.pert_mode not in FIX_PERT_MODES:
            raise ConfigError(f"pert_mode: {opts.pert_mode!r} cannot fix outputs; handler_type \"fix\" needs "
                              f"one of {', '.join(FIX_PERT_MODES)}")
        if opts.fuzz_stage != "forward":
            raise ConfigError("fuzz_stage: handler_type \"fix\" substitutes forward outputs only; use \"forward\"")
        if opts.if_preheat:
            raise ConfigError("if_preheat: preheating is a check-mode feature; set it false with handler_type \"fix\"")
    if (opts.fuzz_device == "cpu") != (opts.pert_mode == "to_cpu"):
        raise ConfigError(f"fuzz_device: {opts.fuzz_device!r} with pert_mode {opts.pert_mode!r}: "
                          "\"cpu\" goes with \"to_cpu\" and only with it")
    # the predecessor's own example writes "if_preheat": false beside preheat_step/max_sample: inert then
    if "if_preheat" not in section and ("preheat_step" in section or "max_sample" in section):
        raise ConfigError("preheat_step/max_sample: need \"if_preheat\": true")
    return opts


def _diff_check(section: dict) -> DiffCheckOptions:
    if "bench_path" not in section:
        raise ConfigError("bench_path: required: the reference dump (a dump_path of an earlier run)")
    path = section["bench_path"]
    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise ConfigError(f"bench_path: expected a path, got {path!r}")
    if not Path(path).is_dir():
        raise ConfigError(f"bench_path: {str(path)!r} is not a directory")
    return DiffCheckOptions(bench_path=Path(path), diff_nums=_count(section.get("diff_nums", 1), "diff_nums"),
                            rtol=_tolerance(section.get("rtol", 1e-3), "rtol"),
                            atol=_tolerance(section.get("atol", 1e-6), "atol"))


# ---- values -------------------------------------------------------------------------------
def _one_of(section: dict, key: str, allowed: tuple[str, ...], default: str) -> str:
    value = section.get(key, default)
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
    return value


def _flag(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):  # the predecessor's documentation writes "if_preheat": "true"
        return value == "true"
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _count(value: Any, key: str, allow_all: bool = True) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or (allow_all and value == -1)):
        extra = " or -1 (all)" if allow_all else ""
        raise ConfigError(f"{key}: expected a positive integer{extra}, got {value!r}")
    return value


def _tolerance(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ConfigError(f"{key}: expected a finite number >= 0, got {value!r}")
    return float(value)


_PARSERS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "overflow_check": (_overflow, ("overflow_nums", "check_mode")),
    "grad_probe": (_grad_probe, ("grad_level", "param_list", "bounds")),
    "free_benchmark": (_free_benchmark, ("pert_mode", "handler_type", "fuzz_level", "fuzz_stage", "fuzz_device",
                                         "if_preheat", "preheat_step", "max_sample", "improve_float32")),
    "diff_check": (_diff_check, ("bench_path", "diff_nums", "rtol", "atol")),
}
