"""The predecessor's checks of `seed_all`'s arguments (shared by the PyTorch and MindSpore versions)."""
from __future__ import annotations

from msprobe_engine.errors import ConfigError

#: the predecessor's bound on the seed
MAX_SEED = 2 ** 32 - 1


def check_seed_arguments(seed: object, **flags: object) -> None:
    """`seed` an integer in 0..MAX_SEED and each flag a bool, else one `ConfigError` naming it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed_all: seed: expected an integer in 0..{MAX_SEED}, got {seed!r}")
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"seed_all: {key}: expected true or false, got {value!r}")
