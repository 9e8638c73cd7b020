"""Serve runs with TensorBoard itself, each plugin name once.

`tensorboard` refuses to start when two installed packages register a plugin under one
name: the predecessor (mindstudio-probe) and tb-graph-ascend both bring `graph_ascend`,
and then ``tensorboard --logdir ...`` fails with "Duplicate plugins for name graph_ascend".
`serve` runs the same server with the first plugin of each name.
"""
from __future__ import annotations

from typing import Any


def unique_plugins() -> list[Any]:
    """TensorBoard's own plugins and the installed ones, the first of each name."""
    from tensorboard import default

    plugins, names = [], set()
    for plugin in default.get_plugins():
        name = getattr(plugin, "plugin_name", None)
        if name is None or name not in names:
            plugins.append(plugin)
            names.add(name)
    return plugins


def serve(logdir: str, host: str, port: int) -> int:
    """Run the TensorBoard server on `logdir` until interrupted."""
    from tensorboard import program

    board = program.TensorBoard(plugins=unique_plugins())
    board.configure(logdir=logdir, host=host, port=port)
    return board.main()
