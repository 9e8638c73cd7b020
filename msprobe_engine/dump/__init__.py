"""msprobe-compatible dump format: schema (dump.json) and reader (dump directories)."""
from msprobe_engine.dump.reader import DumpError, RankDump, find_rank_dirs, load_dump, load_rank_dir
from msprobe_engine.dump.schema import (EntryName, TensorRef, has_nonfinite, iter_dump_tensors, iter_tensors,
                                        parse_entry_name, validate_dump_json, validate_entry)

__all__ = ["DumpError", "EntryName", "RankDump", "TensorRef", "find_rank_dirs", "has_nonfinite",
           "iter_dump_tensors", "iter_tensors", "load_dump", "load_rank_dir", "parse_entry_name",
           "validate_dump_json", "validate_entry"]

# The dump session (torch is imported at its first start(), not here).
from msprobe_engine.dump.config import DumpConfig, load_dump_config  # noqa: E402
from msprobe_engine.dump.session import PrecisionDebugger  # noqa: E402

__all__ += ["DumpConfig", "PrecisionDebugger", "load_dump_config"]
