"""The built-in sinks, one file each (importing this module registers them)."""
from msprobe_engine.sinks import (csv_sink, jsonl_sink, mlflow_sink, predecessor_csv, tensorboard_sink,  # noqa: F401
                                  wandb_sink)
from msprobe_engine.sinks import router_heatmap  # noqa: F401
