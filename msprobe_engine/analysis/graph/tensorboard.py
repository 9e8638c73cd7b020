"""The command that shows a `graph` output directory in TensorBoard with tb-graph-ascend.

mindstudio-probe (the predecessor) bundles its own copy of the plugin under the same plugin
name, ``graph_ascend``; with both packages installed, ``tensorboard`` refuses to start
(``ValueError: Duplicate plugins for name graph_ascend``). Then the command starts
TensorBoard with its own plugins and tb-graph-ascend's only.
"""
from __future__ import annotations

import shlex
import sys
from importlib.metadata import entry_points
from pathlib import Path

PLUGIN_NAME = "graph_ascend"
PLUGIN_MODULE = "server.plugin"  # tb-graph-ascend's top-level package is `server`
LAUNCH = ("import sys; from tensorboard import default, program; from server.plugin import GraphsPlugin; "
          "b = program.TensorBoard(plugins=default.get_static_plugins() + [GraphsPlugin]); "
          "b.configure(argv=[None] + sys.argv[1:]); b.main()")


def tensorboard_command(logdir: Path | str) -> list[str]:
    """``tensorboard --logdir <logdir>``, or, when another package registers a second
    ``graph_ascend`` plugin, this Python running TensorBoard with tb-graph-ascend's alone."""
    plugins = [ep for ep in entry_points(group="tensorboard_plugins") if ep.name == PLUGIN_NAME]
    if len(plugins) > 1 and any(ep.value.startswith(PLUGIN_MODULE + ":") for ep in plugins):
        return [sys.executable, "-c", LAUNCH, "--logdir", str(logdir)]
    beside = Path(sys.executable).with_name("tensorboard")
    return [str(beside) if beside.exists() else "tensorboard", "--logdir", str(logdir)]


def format_command(logdir: Path | str) -> str:
    """`tensorboard_command` as a shell line."""
    return shlex.join(tensorboard_command(logdir))
