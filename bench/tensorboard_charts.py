"""How many charts TensorBoard's landing page (Time Series) shows, per model, by default.

Each model trains 2 monitored steps with the default config (random init, no download),
the tensorboard sink writing a real event file; the charts are the scalar tags and the
heatmap images TensorBoard reads back (EventAccumulator). "every tag" is the same run with
the sink keeping every per-layer tag (what the sink wrote before its `layer_kinds` /
`layer_stats` keys). The LAST printed line is one JSON object.

    OMP_NUM_THREADS=1 python bench/tensorboard_charts.py
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from examples.tiny_gpt import TinyGPT  # noqa: E402
from msprobe_engine.sinks.tb_layout import LAYER_KINDS  # noqa: E402
from msprobe_engine.stats import STATISTICS  # noqa: E402
from msprobe_integrations.torch import TorchMonitor  # noqa: E402

EVERY_TAG = {"name": "tensorboard", "layer_kinds": list(LAYER_KINDS), "layer_stats": list(STATISTICS.names())}


def models():
    """name -> (model, its loss on a batch): the demo's, GPT-2 small, a 32-layer Llama-style config."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tiny = TinyGPT()
    tokens = torch.randint(0, tiny.cfg.vocab, (2, 16))
    yield "demo (TinyGPT, 2 layers)", tiny, lambda: tiny(tokens, tokens)
    gpt2 = GPT2LMHeadModel(GPT2Config())  # 12 layers, 768 wide: GPT-2 small
    ids = torch.randint(0, 1000, (1, 8))
    yield "GPT-2 small (12 layers)", gpt2, lambda: gpt2(ids, labels=ids).loss
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=32, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=1000))
    yield "32-layer Llama-style (narrow)", llama, lambda: llama(ids, labels=ids).loss


def charts(model, loss_of, tensorboard, out: Path) -> dict[str, int]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    monitor = TorchMonitor(model, optimizer, {"output_dir": str(out), "run_name": "r", "sinks": [tensorboard]})
    for _ in range(2):
        loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step_end(loss)
    monitor.close()
    events = EventAccumulator(str(out / "r" / "rank0"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    scalars = events.Tags()["scalars"]
    images = [t for t in events.Tags()["tensors"] if t.startswith("Heatmap/")]
    return {"charts": len(scalars) + len(images), "health": sum(t.startswith("Health/") for t in scalars) + len(images)}


def main() -> None:
    torch.manual_seed(0)
    result = {}
    for name, model, loss_of in models():
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            default = charts(model, loss_of, "tensorboard", Path(a))
            every = charts(model, loss_of, EVERY_TAG, Path(b))
        result[name] = {"default": default["charts"], "health group": default["health"], "every tag": every["charts"]}
        print(f"{name}: {default['charts']} charts ({default['health']} in Health), every tag {every['charts']}",
              flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
