"""What an incident records about the run (config hash, versions, rank and world layout), and the
environment snapshot every run writes at start (`snapshot`, compared by ``msprobe-engine config-check``)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import socket
import sys
from importlib import metadata
from pathlib import Path
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


# ---- the run's environment snapshot (environment.json, compared by `config-check`) ---------
#: the file every writing rank's directory gets at start
ENVIRONMENT_FILE = "environment.json"
#: installed packages whose version can change the numbers (recorded when installed)
NUMERIC_PACKAGES = ("torch", "numpy", "scipy", "triton", "mindspore", "deepspeed", "megatron-core", "transformers",
                    "accelerate", "lightning", "pytorch-lightning", "apex", "transformer-engine", "flash-attn",
                    "nvidia-cublas-cu12", "nvidia-cudnn-cu12", "nvidia-nccl-cu12", "mindstudio-probe", PACKAGE)
#: environment variables that change numerics or collectives (exact names, or prefixes ending in _)
NUMERIC_ENV = ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED", "NVIDIA_TF32_OVERRIDE", "CUDA_", "NCCL_", "OMP_",
               "MKL_", "KMP_", "OPENBLAS_", "TORCH_", "PYTORCH_", "CUDNN_", "HCCL_", "ASCEND_", "MS_")


def installed_packages() -> dict[str, str]:
    """Versions of the installed `NUMERIC_PACKAGES` (absent ones left out)."""
    found = {}
    for name in NUMERIC_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def numeric_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables of `NUMERIC_ENV` that are set, sorted by name."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ)
            if any(k.startswith(p) if p.endswith("_") else k == p for p in NUMERIC_ENV)}


def snapshot(config: Any, rank: int, layout: dict[str, Any]) -> dict[str, Any]:
    """What `config-check` compares: Python, packages, imported frameworks, numerics-relevant
    environment variables, the world, the monitor config (its hyper-parameters); sections added
    later by `Monitor.record_environment` (hyperparameters, data, weights) join it."""
    return {"python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                       "platform": platform.platform()},
            "packages": installed_packages(), "frameworks": versions(), "env": numeric_env(),
            "world": world(rank, layout), "config": json.loads(json.dumps(dataclasses.asdict(config), default=str))}


def write_snapshot(rank_dir: Path, document: dict[str, Any]) -> None:
    """Write (or merge `document`'s sections into) ``<rank_dir>/environment.json`` (writer thread)."""
    file = Path(rank_dir) / ENVIRONMENT_FILE
    current = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    current.update(document)
    partial_file = file.with_name(f".{ENVIRONMENT_FILE}.partial")
    partial_file.write_text(json.dumps(current, indent=1, sort_keys=False, default=str), encoding="utf-8")
    os.replace(partial_file, file)
