"""The single-pass C reduction kernel (`cpu_reduce.c`) and its loader (`library`), shared by the frameworks.

The C file uses no Python or framework API; the torch framework calls it with ctypes
(`frameworks/torch/cpu_reduce.py`), MindSpore as custom operators inside compiled graphs
(`frameworks/mindspore/kernel_op.py`). This package imports no framework.
"""
