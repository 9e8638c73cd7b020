"""Shared test set-up: one thread per process, strict mode, the repo on sys.path."""
import importlib.machinery
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# tests written before run directories look in <output_dir>/rank<R>/: the run name "." keeps
# that layout for them; tests/test_run_dir.py and tests/test_tensorboard.py unset it
os.environ.setdefault("MSPROBE_RUN_NAME", ".")
ROOT = Path(__file__).resolve().parents[1]
# a checkout used without `pip install` by this interpreter has no C kernel in the package that it
# loads (the 3.12 lane runs the checkout an install for 3.11 built into; or the library is older
# than its source, after an edit): the tests build it at run time (cpu_kernel/library.py's opt-in) instead
_KERNEL = ROOT / "msprobe_engine" / "cpu_kernel"
_BUILT = [p for p in (_KERNEL / f"_cpu_reduce{s}" for s in importlib.machinery.EXTENSION_SUFFIXES) if p.is_file()]
if not _BUILT or min(p.stat().st_mtime for p in _BUILT) < (_KERNEL / "cpu_reduce.c").stat().st_mtime:
    os.environ.setdefault("MSPROBE_CPU_KERNEL", "build")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

torch.set_num_threads(1)
