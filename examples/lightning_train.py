"""Train a random-init GPT-2 in a LightningModule with the monitor's callback.

    OMP_NUM_THREADS=1 python -m examples.lightning_train                 # CPU, one process
    OMP_NUM_THREADS=1 python -m examples.lightning_train --nan-at 3      # a nan in one layer: an incident

The one added line is `callbacks=[MonitorCallback(config=...)]`. Then:
`tensorboard --logdir <output-dir>`.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from examples.hf_trainer import LAYER, inject_nan, summarize, tiny_gpt2, token_rows


def lit_gpt2(lr: float = 1e-3, **sizes: int):
    """A LightningModule training `tiny_gpt2(**sizes)` with AdamW at `lr`."""
    import lightning.pytorch as pl

    class LitGPT2(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = tiny_gpt2(**sizes)

        def training_step(self, batch, batch_idx):
            return self.gpt(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    return LitGPT2()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="./lightning_output")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=2, help="batches per optimizer step")
    parser.add_argument("--nan-at", type=int, help=f"make gpt.{LAYER}'s output nan at this step")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from msprobe_integrations.lightning import MonitorCallback

    module = lit_gpt2()
    if args.nan_at is not None:
        inject_nan(module.gpt, LAYER, args.nan_at, args.accumulation)
    callback = MonitorCallback(config={"output_dir": args.output_dir, "sinks": ["tensorboard", "jsonl"],
                                       "alerts": [{"rule": "non_finite", "action": "skip"}, {"rule": "spike"}]})
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, accumulate_grad_batches=args.accumulation,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=args.output_dir, callbacks=[callback])
    trainer.fit(module, DataLoader(token_rows(256), batch_size=4))
    summarize(callback.monitor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
