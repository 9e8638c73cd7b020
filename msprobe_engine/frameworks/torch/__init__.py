"""PyTorch: statistics backend, module and optimizer hooks, replay and dump capture."""
