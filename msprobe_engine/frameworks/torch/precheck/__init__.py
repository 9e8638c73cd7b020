"""PyTorch side of the API pre-check: replay (`replay`), inputs from records or statistics
(`inputs`), the online sender on the training side (`online`), reproduction scripts (`repro`)."""
