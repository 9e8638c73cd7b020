"""Collection: which tensors are measured, under which names, and when."""
