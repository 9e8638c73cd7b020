"""Adapters that attach the msprobe engine to training frameworks and trainers.

One module (or package) per framework, each a `msprobe_engine.contract.Integration` over a
`Monitor`. Importing this package imports no framework; importing one of its modules imports
that module's framework (`msprobe_integrations.deepspeed` imports deepspeed, and so on).
"""
