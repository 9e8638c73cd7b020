"""The configs shipped inside the package, selectable by name.

`msprobe_engine/configs/` (the repository's `configs/` folder, linked) travels in the wheel.
Each monitor config there has a name: its path under that folder without the suffix (`full`,
`minimal`, `grads_optimizer`, `deepspeed/monitor`, `megatron/monitor`, `mindspore/monitor`,
`mindspore/graph_mode`, `predecessor_monitor`), and a folder's `monitor` config also answers to
the folder's name (`deepspeed`, `megatron`, `mindspore`). The DeepSpeed configs in
`deepspeed/*.json` ship too (the examples read them) but are not monitor configs.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Union

from msprobe_engine.errors import ConfigError

#: where the shipped configs lie inside the installed package
FOLDER = Path(__file__).resolve().parents[1] / "configs"
#: the suffixes a config path may have
SUFFIXES = (".yaml", ".yml", ".json")


def names() -> dict[str, Path]:
    """Every shipped monitor config by name (the YAML files, and the JSON ones at the top)."""
    found = sorted([*FOLDER.rglob("*.yaml"), *FOLDER.glob("*.json")])
    table = {path.relative_to(FOLDER).with_suffix("").as_posix(): path for path in found}
    for name, path in list(table.items()):
        folder, _, stem = name.rpartition("/")
        if folder and stem == "monitor":
            table.setdefault(folder, path)
    return dict(sorted(table.items()))


def resolve(source: Union[str, Path]) -> Path:
    """The file a config argument means: an existing path as given; else a shipped config's name
    (`"full"`), or a `configs/...` path of the repository's examples run elsewhere. Anything else
    is a `ConfigError` that lists the names."""
    path = Path(source)
    if path.is_file():
        return path
    table = names()
    name = path.as_posix()
    if name.startswith("configs/"):  # an example's path, outside the repository
        name = name[len("configs/"):]
    if path.suffix in SUFFIXES:
        name = name[: -len(path.suffix)]
    if name in table and (path.suffix in SUFFIXES or not path.suffix):
        return table[name]
    near = difflib.get_close_matches(name, table, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ConfigError(f"{source}: config file not found, and not a shipped config's name{hint}; "
                      f"the shipped configs: {', '.join(table)}")
