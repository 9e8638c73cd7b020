"""Thin adapters that attach the msprobe engine to training frameworks.

One module per framework; each imports its framework lazily, so importing
this package costs nothing.
"""
