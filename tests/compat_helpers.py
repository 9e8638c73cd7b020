"""The predecessor's documented usage examples (tests/fixtures/predecessor_examples/), run in a
child process as written and with only the import line changed, and their dumps compared."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent / "fixtures" / "predecessor_examples"
ROOT = Path(__file__).resolve().parents[1]
#: (the predecessor's import, ours) of each drop-in
PYTORCH_IMPORTS = ("from msprobe.pytorch import", "from msprobe_engine.compat import")
MINDSPORE_IMPORTS = ("from msprobe.mindspore import", "from msprobe_engine.compat.mindspore import")
#: lines run before the predecessor's MindSpore code on CPU: its statistics call `mint.norm`, whose
#: kernel is not registered on MindSpore's CPU backend; here ``norm`` is ``sqrt(sum(x * x))``
CPU_NORM = """
import msprobe.core.dump.data_dump.data_processor.mindspore_processor as _processor
from mindspore import ops as _ops


class _CpuMint:
    def __init__(self, mint):
        self._mint = mint

    def __getattr__(self, name):
        return getattr(self._mint, name)

    @staticmethod
    def norm(x):
        return _ops.sqrt(_ops.sum(x * x))


_processor.mint = _CpuMint(_processor.mint)
"""


def run_example(name: str, tmp: Path, ours: bool, config: dict | None = None, dump_config: bool = True,
                imports: tuple[str, str] = PYTORCH_IMPORTS, their_prelude: str = "") -> tuple[Path, str]:
    """Run example `name` (ours: with the import line changed) with `config` (a dump config gets
    the run's dump_path); `their_prelude`: lines run before the predecessor's side only (a
    workaround for its CPU gaps, never part of the example). (its dump_path or monitor output
    directory, its output)."""
    theirs_import, ours_import = imports
    text = (EXAMPLES / name).read_text(encoding="utf-8")
    assert text.count(theirs_import) == 1
    side = "ours" if ours else "theirs"
    script = tmp / f"{side}_{name}"
    script.write_text(text.replace(theirs_import, ours_import) if ours else their_prelude + text, encoding="utf-8")
    dump_path = tmp / f"{side}_{Path(name).stem}"
    config_path = tmp / f"{side}_{Path(name).stem}.json"
    extra = {"dump_path": str(dump_path)} if dump_config else {}
    config_path.write_text(json.dumps({**(config or {}), **extra}), encoding="utf-8")
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
           "MONITOR_OUTPUT_DIR": str(dump_path), "MSPROBE_RUN_NAME": "."}
    done = subprocess.run([sys.executable, str(script), str(config_path), str(dump_path)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp)
    assert done.returncode == 0, f"{side} {name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return dump_path, done.stdout


def step_documents(dump_path: Path, file: str = "dump.json") -> dict[str, dict]:
    """step directory name -> the one rank directory's `file`, parsed."""
    out = {}
    for step_dir in sorted(dump_path.glob("step*")):
        (rank_dir,) = [d for d in step_dir.iterdir() if d.is_dir() and not d.name.startswith(".")]
        out[step_dir.name] = json.loads((rank_dir / file).read_text(encoding="utf-8"))
    return out


def same_records(ours, theirs, where: str) -> None:
    """Records equal field for field; statistics to float32 rounding (ours sum in float64)."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), where
        for key in theirs:
            if key in ("Max", "Min", "Mean", "Norm") and isinstance(theirs[key], float):
                assert math.isclose(ours[key], theirs[key], rel_tol=1e-6, abs_tol=1e-7), f"{where}.{key}"
            else:
                same_records(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            same_records(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where
