"""msprobe-compatible dump format: schema (dump.json) and reader (dump directories)."""
from msprobe_engine.dump.reader import DumpError, RankDump, find_rank_dirs, load_dump, load_rank_dir
from msprobe_engine.dump.schema import (EntryName, TensorRef, has_nonfinite, iter_dump_tensors, iter_tensors,
                                        parse_entry_name, validate_dump_json, validate_entry)

__all__ = ["DumpError", "EntryName", "RankDump", "TensorRef", "find_rank_dirs", "has_nonfinite",
           "iter_dump_tensors", "iter_tensors", "load_dump", "load_rank_dir", "parse_entry_name",
           "validate_dump_json", "validate_entry"]

from msprobe_engine.dump.config import DumpConfig, load_dump_config  # noqa: E402

__all__ += ["DumpConfig", "PrecisionDebugger", "load_dump_config"]


def __getattr__(name: str):
    """`PrecisionDebugger`: the dump session of either framework (`dump.facade`), loaded on first
    use (no framework is imported before a session is made)."""
    if name == "PrecisionDebugger":
        from msprobe_engine.dump.facade import PrecisionDebugger
        return PrecisionDebugger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
