#!/usr/bin/env python3
"""The Python side of the GPU check's step-time ratio: the same model and step in PyTorch.

    python bench/gpu/python_step.py --preset gpt2-124m --batch 8 --seq 1024 \
        --precision bf16-mixed --checkpoint-blocks --compile --steps 8 --warmup 3 --result OUT.json

kiln's twin of the model (python/kiln_py, kiln's parameter names and forward), AdamW (fused on
CUDA), gradient clipping at 1.0, batches preloaded on the device, the forward and loss under
torch.autocast(device, bfloat16) for bf16-mixed, each block under checkpoint_wrapper with
--checkpoint-blocks (kiln's train.activation_checkpointing = "block"), torch.compile (Inductor,
default mode) with --compile. Each timed step ends with loss.item(), as kiln's timed steps end with
a read-back. Writes the median step time, every step's time and the first iteration's seconds.
scripts/gpu-check runs it in the same call as kiln's ladder, with the ladder's options, and
reports kiln / this ratio.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

from kiln_py.models import from_config, loss as model_loss  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--precision", choices=("fp32", "bf16-mixed"), default="bf16-mixed")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpoint-blocks", action="store_true",
                        help="activation checkpointing per transformer block")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = from_config({"name": "gpt", "preset": args.preset}).to(device)
    model.train()
    if args.checkpoint_blocks:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = checkpoint_wrapper(block)
    vocab = model.transformer.wte.weight.shape[0]
    inputs = torch.randint(0, vocab, (args.batch, args.seq), device=device)
    targets = torch.randint(0, vocab, (args.batch, args.seq), device=device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-4, fused=device.type == "cuda")
    run_model = torch.compile(model) if args.compile else model
    autocast = args.precision == "bf16-mixed"

    def step():
        begin = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model_loss(run_model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss.item()
        return time.perf_counter() - begin

    first = step()
    for _ in range(args.warmup):
        step()
    seconds = [step() for _ in range(args.steps)]
    result = {"preset": args.preset, "batch": args.batch, "seq": args.seq,
              "precision": args.precision, "compile": args.compile,
              "checkpoint_blocks": args.checkpoint_blocks, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
              "torch": torch.__version__, "first_iteration_seconds": first,
              "warmup": args.warmup, "step_seconds": seconds,
              "median_step_seconds": statistics.median(seconds),
              "tokens_per_second": args.batch * args.seq / statistics.median(seconds)}
    with open(args.result, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    side = ("torch.compile" if args.compile else "eager") + (" + checkpointing" if
                                                              args.checkpoint_blocks else "")
    print(f"python {side} {args.precision}: {1e3 * result['median_step_seconds']:.1f} ms/step "
          f"({result['tokens_per_second']:.0f} tokens/s; first iteration {first:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
