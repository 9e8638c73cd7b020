"""What an incident records about the run: config hash, versions, rank and world layout."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import socket
import sys
from importlib import metadata
from typing import Any

#: frameworks whose version is recorded when the run has imported them (never imported here)
FRAMEWORKS = ("torch", "deepspeed", "megatron.core", "mindspore", "transformers")
PACKAGE = "msprobe-integrations"


def config_hash(config: Any) -> str:
    """sha256 (first 16 hex digits) of the config's canonical JSON: equal configs, equal hash."""
    text = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def versions() -> dict[str, str]:
    """Python, this package, numpy and every framework the process has imported."""
    import numpy

    found = {"python": platform.python_version(), "numpy": numpy.__version__}
    try:
        found[PACKAGE] = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        found[PACKAGE] = "not installed"
    for name in FRAMEWORKS:
        module = sys.modules.get(name)
        if module is not None:
            found[name] = str(getattr(module, "__version__", "unknown"))
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch.version, "cuda", None):
        found["cuda"] = str(torch.version.cuda)
    return found


def world(rank: int, layout: dict[str, Any]) -> dict[str, Any]:
    """rank, world size, local rank and host, plus the integration's parallel `layout`."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        size = dist.get_world_size()
    return {"rank": rank, "world_size": size, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "host": socket.gethostname(), **layout}
