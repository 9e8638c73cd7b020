"""Framework code: the only place that imports torch or mindspore.

One sub-package per framework (`torch`, `mindspore`), each holding its statistics
backend (batched reductions, the distributed merge), its hooks (modules, optimizer,
tensor flow, replay) and its dump capture (`capture/`). The engine core finds a
framework by name through `msprobe_engine.registry.frameworks`, never by importing it.
"""
