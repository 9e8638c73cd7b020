"""The built-in model-health signals, one file each; importing this package registers them
(`health_hooks.SIGNALS`), in the order their hooks are installed."""
from msprobe_engine.frameworks.torch.signals import attention_entropy, micro_batch_grads  # noqa: F401,I001
from msprobe_engine.frameworks.torch.signals import stable_rank, mg_direction, collectives  # noqa: F401,I001
