"""MindSpore dump capture: Cell hooks, the recorder and the PrecisionDebugger session."""
