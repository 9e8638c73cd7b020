"""One training step of a `pairing_models` model dumped by the predecessor or by us, in a process
of its own (the predecessor patches torch process-wide):

    python pairing_run.py theirs|ours <model> <dump_path> <level>
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from pairing_models import train_step  # noqa: E402
from predecessor_helpers import dump_config  # noqa: E402

tool, name, dump_path, level = sys.argv[1:5]
torch.set_num_threads(1)
config = dump_config(Path(dump_path), level)
if tool == "theirs":
    from msprobe.pytorch import PrecisionDebugger
    config_file = Path(dump_path).parent / f"{Path(dump_path).name}.config.json"
    config_file.write_text(json.dumps(config))
    debugger = PrecisionDebugger(config_path=str(config_file))
else:
    from msprobe_engine.dump import PrecisionDebugger
    debugger = PrecisionDebugger(config)
print(train_step(name, debugger).item())
if tool == "ours":
    debugger.close()
