"""Serve runs with TensorBoard itself, each plugin name once, quiet about plugins with no data.

`tensorboard` refuses to start when two installed packages register a plugin under one
name: the predecessor (mindstudio-probe) and tb-graph-ascend both bring `graph_ascend`,
and then ``tensorboard --logdir ...`` fails with "Duplicate plugins for name graph_ascend".
`serve` runs the same server with one plugin of each name (tb-graph-ascend's `graph_ascend`). The predecessor's trend
plugin (`TrendVis`) is left out unless the logdir holds its ``*.trend.db`` (it logs "No trend.db
file found" on every start otherwise, and fails on a missing logdir). A logdir that does not
exist is one line on stderr and exit status 2; one without event files is served with a note.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: the predecessor's plugin that reads its own database, not event files
TREND_PLUGIN = "TrendVis"
#: plugin name -> the module prefix of the copy served when several packages bring one
#: (tb-graph-ascend's own `graph_ascend`, not the predecessor's bundled copy)
PREFERRED = {"graph_ascend": "server."}


def unique_plugins(logdir: str | Path | None = None) -> list[Any]:
    """TensorBoard's own plugins and the installed ones, one of each name (the first, or the
    `PREFERRED` copy; the predecessor's trend plugin only for a `logdir` holding a ``*.trend.db``)."""
    from tensorboard import default

    trend = logdir is not None and any(Path(logdir).glob("*.trend.db"))
    plugins, at = [], {}
    for plugin in default.get_plugins():
        name = getattr(plugin, "plugin_name", None)
        if name == TREND_PLUGIN and not trend:
            continue
        if name is None or name not in at:
            at[name] = len(plugins)
            plugins.append(plugin)
        elif getattr(plugin, "__module__", "").startswith(PREFERRED.get(name, "\0")):
            plugins[at[name]] = plugin
    return plugins


def serve(logdir: str, host: str, port: int) -> int:
    """Run the TensorBoard server on `logdir` until interrupted."""
    from tensorboard import program

    folder = Path(logdir)
    if not folder.is_dir():
        print(f"msprobe-engine tensorboard: --logdir {logdir}: no such directory (give a monitor's output_dir "
              "or one run directory in it)", file=sys.stderr)
        return 2
    if not any(folder.glob("**/events.out.tfevents.*")):
        print(f"msprobe-engine tensorboard: no TensorBoard event files under {logdir} yet (is the tensorboard "
              "sink on?); serving it anyway", file=sys.stderr)
    board = program.TensorBoard(plugins=unique_plugins(folder))
    board.configure(logdir=logdir, host=host, port=port)
    return board.main()
