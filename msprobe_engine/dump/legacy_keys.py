"""Dump config keys of the predecessor's earlier releases (its 1.x documentation) and their fate here.

Each key is accepted at the values that change nothing here (its defaults, "not configured")
and refused at any other value with one error naming what to use instead, so that no key of
a documented config.json is ever an "unknown key". `dump.config` consults `TOP_KEYS`
(top level) and `SECTION_KEYS` (inside the task's section); docs/predecessor.md lists both.
"""
from __future__ import annotations

from typing import Any

#: key -> (the values accepted, what to use instead)
Fate = tuple[tuple[Any, ...], str]
_ONLINE = ("the online pre-check runs beside the training: msprobe_engine.frameworks.torch.precheck.online."
           "OnlinePrecheck(host=, port=) or (nfs_path=) around the steps, and `msprobe-engine run_ut --online` "
           "as the checker (docs/precheck.md)")
_KERNEL = "kernel-level (L2) dumps of Ascend are not implemented; dump APIs with level L1 or mix"

TOP_KEYS: dict[str, Fate] = {
    "acl_config": ((None, ""), _KERNEL),
}
SECTION_KEYS: dict[str, Fate] = {
    "backward_input": ((None, []), _KERNEL),
    "file_format": ((None, "npy", "bin"), "MindSpore static-graph (L2) dumps are not implemented; tensors are "
                                          "saved as .pt (PyTorch) or .npy (MindSpore)"),
    "online_run_ut": ((None, False), _ONLINE),
    "online_run_ut_recompute": ((None, False), _ONLINE),
    "nfs_path": ((None, ""), _ONLINE),
    "host": ((None, ""), _ONLINE),
    "port": ((None, -1), _ONLINE),
    "tls_path": ((None, ""), _ONLINE),
}
#: the predecessor's tasks that configure another tool: what to run instead of a dump
OTHER_TASK_USE = {
    "run_ut": "its section configures the pre-check: `msprobe-engine run_ut -i <dump> --config <this file>` "
              "(dump with task 'tensor' first), or online: `msprobe-engine run_ut --online --config <this file>`",
    "acc_check": "its section (26.x's name for run_ut's) configures the pre-check: name it run_ut and run "
                 "`msprobe-engine run_ut -i <dump> --config <this file>`",
    "structure": "task 'statistics' at level L0 or mix writes construct.json with the module structure",
}
