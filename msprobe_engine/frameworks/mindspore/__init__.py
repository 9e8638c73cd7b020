"""MindSpore: statistics backend, Cell hooks and dump capture (PyNative mode)."""
