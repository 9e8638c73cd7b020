"""PyTorch dump capture: API-level interception, module and backward hooks, the recorder."""
