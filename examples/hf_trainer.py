"""Train a random-init GPT-2 with the Hugging Face Trainer and the monitor's callback.

    OMP_NUM_THREADS=1 python -m examples.hf_trainer                  # CPU, one process
    OMP_NUM_THREADS=1 python -m examples.hf_trainer --nan-at 3       # a nan in one layer: an incident
    # ZeRO-2 on 2 CPU ranks; the monitor's config is the "msprobe" block of the DeepSpeed config
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m examples.hf_trainer \
        --deepspeed configs/deepspeed/hf_zero2.json

The one added line is `callbacks=[MonitorCallback(config=...)]`. Then:
`tensorboard --logdir <output-dir>` (or the DeepSpeed config's output_dir).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

LAYER = "transformer.h.1.mlp"


def tiny_gpt2(n_layer: int = 2, n_embd: int = 64, n_head: int = 4):
    """A random-init GPT-2 over 256 token ids (2 layers of width 64: 0.1M parameters by default)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=256, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def token_rows(count: int, seq: int = 32) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, 256, (seq,), generator=generator) for _ in range(count)]
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def inject_nan(model, layer: str, at_step: int, accumulation: int) -> None:
    """Make `layer`'s output nan during optimizer step `at_step` (the trainer's global_step
    after it, as the monitor numbers it: the first step is 1; a fault to find)."""
    forwards = {"n": 0}

    def count(module, args):
        forwards["n"] += module.training

    def corrupt(module, args, output):
        return output * float("nan") if module.training and (forwards["n"] - 1) // accumulation + 1 == at_step else None

    model.register_forward_pre_hook(count)
    model.get_submodule(layer).register_forward_hook(corrupt)


def summarize(monitor) -> None:
    """The last step, the alerts, and where to look (rank 0)."""
    if monitor.rank != 0 or not monitor.history:
        return
    last = monitor.history[-1]
    print(f"{len(monitor.history)} steps monitored; step {last.step}: loss {last.metrics['train/loss']:.4f}, "
          f"gradient norm (before clipping) {last.metrics['grad/global/norm']:.4f}")
    for event in monitor.alert_log:
        print(f"alert {event.rule} {event.phase} at step {event.step}: {event.tag}")
    print(f"tensorboard --logdir {monitor.config.output_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="./hf_output")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--nan-at", type=int, help=f"make {LAYER}'s output nan at this step (the global_step, from 1)")
    parser.add_argument("--deepspeed", help="a DeepSpeed config (JSON) whose \"msprobe\" block is the monitor's")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.deepspeed:
        from examples.deepspeed_train import init_distributed
        init_distributed()  # gloo on CPU, without the shared-memory op's JIT build

    from transformers import Trainer, TrainingArguments

    from msprobe_integrations.hf import MonitorCallback

    model = tiny_gpt2()
    if args.nan_at is not None:
        inject_nan(model, LAYER, args.nan_at, args.accumulation)
    config = None if args.deepspeed else {"output_dir": args.output_dir, "sinks": ["tensorboard", "jsonl"],
                                          "alerts": [{"rule": "non_finite", "action": "skip"}, {"rule": "spike"}]}
    training = TrainingArguments(output_dir=os.path.join(args.output_dir, "trainer"), use_cpu=not args.deepspeed,
                                 report_to=[], save_strategy="no", disable_tqdm=True, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=args.accumulation, max_steps=args.steps,
                                 learning_rate=1e-3, logging_steps=args.steps, deepspeed=args.deepspeed)
    callback = MonitorCallback(config=config)
    trainer = Trainer(model=model, args=training, train_dataset=token_rows(256), callbacks=[callback])
    trainer.train()
    summarize(callback.monitor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
