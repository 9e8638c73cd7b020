"""Backends: the only code that touches a framework's tensors.

Each backend turns a batch of tensors into partial statistics (see
`msprobe_engine.stats`) on the tensors' own device, and moves one packed
result to the host per monitored step.
"""
