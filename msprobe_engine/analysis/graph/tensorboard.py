"""The command that shows a `graph` output directory in TensorBoard with tb-graph-ascend:
``msprobe-engine tensorboard --logdir <dir>``.

mindstudio-probe (the predecessor) bundles its own copy of the plugin under the same plugin
name, ``graph_ascend``; with both packages installed, ``tensorboard`` itself refuses to start
(``ValueError: Duplicate plugins for name graph_ascend``). The `tensorboard` verb starts
TensorBoard with one plugin of each name (`sinks/tb_server.py`), so it is the command printed.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path


def tensorboard_command(logdir: Path | str) -> list[str]:
    """``msprobe-engine tensorboard --logdir <logdir>``: the console script beside this Python
    when there is one, else this Python running the verb (``-m msprobe_engine``)."""
    beside = Path(sys.executable).with_name("msprobe-engine")
    verb = [str(beside)] if beside.exists() else [sys.executable, "-m", "msprobe_engine"]
    return [*verb, "tensorboard", "--logdir", str(logdir)]


def format_command(logdir: Path | str) -> str:
    """`tensorboard_command` as a shell line."""
    return shlex.join(tensorboard_command(logdir))
