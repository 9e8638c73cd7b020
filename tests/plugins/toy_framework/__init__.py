"""A user's framework, from outside the package (docs/architecture.md, "A framework"): "toy",
numpy arrays in a tensor class of its own, a two-layer linear model and an SGD optimizer with
hooks. Importing this package registers it; `adapter.py` is imported on first use."""
from msprobe_engine.registry import register_framework

register_framework("toy", "tests.plugins.toy_framework.adapter", packages=("tests.plugins.toy_framework",),
                   dump_format="mindspore")  # its dumps: Cell-style names and .npy files
