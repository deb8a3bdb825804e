#!/usr/bin/env python3
"""Replay kiln's first training steps in Python PyTorch and compare them step by step.

kiln writes what a peer needs (`kiln peer export`): the resolved config, the initial weights and
the exact batches. This script builds the same model in plain PyTorch (the twins
of python/kiln_py/models.py, nothing shared with kiln's C++), loads those weights, consumes those
batches with the same optimizer, schedule and clipping, and compares the per-step losses. With
--timing it also times both sides in the same run (median step time, batches preloaded in memory on
both sides, same thread count) and reports kiln/Python.

    peer.py --kiln build/kiln --config configs/mlp.toml --steps 25 --tolerance 1e-5
    peer.py --kiln build/kiln --config configs/gpt-tiny.toml --steps 60 --timing \
            --result bench/results/baseline-gpt-tiny.json

Exit status: 0 when every step agrees within the tolerance, 1 otherwise.
"""
import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib

import torch
from safetensors.torch import load_file

# The model twins are a product component (python/kiln_py, also used by kiln's compile step).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from kiln_py import models  # noqa: E402


# ---- optimizer and schedule (PyTorch's own) -----------------------------------------------------

def make_optimizer(model, o):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    if o["name"] == "adamw":
        return torch.optim.AdamW(groups, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"],
                                 fused=o["fused"])
    return torch.optim.SGD(groups, lr=o["lr"], momentum=o["momentum"], nesterov=o["nesterov"],
                           fused=o["fused"])


def learning_rate(cfg, step):
    o = cfg["optim"]
    peak, warmup = o["lr"], o["warmup_steps"]
    if step < warmup:
        return peak * (step + 1) / warmup
    if o["schedule"] == "constant":
        return peak
    span = max(1, cfg["train"]["steps"] - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = peak * o["min_lr_ratio"]
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)


# ---- replay ---------------------------------------------------------------------------------------

def export(kiln, config, steps, out, overrides):
    cmd = [kiln, "peer", "export", config, "--steps", str(steps), "--out", out]
    for o in overrides:
        cmd += ["--set", o]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "kiln.json")) as f:
        return json.load(f)


def replay(out, steps):
    with open(os.path.join(out, "config.toml"), "rb") as f:
        cfg = tomllib.load(f)
    if cfg["run"]["threads"] > 0:
        torch.set_num_threads(cfg["run"]["threads"])
    if cfg["run"]["deterministic"]:
        torch.use_deterministic_algorithms(True, warn_only=True)
    model = models.from_config(cfg["model"])
    model.load_state_dict(load_file(os.path.join(out, "init.safetensors")), strict=True)
    model.train()
    optimizer = make_optimizer(model, cfg["optim"])
    batches = load_file(os.path.join(out, "batches.safetensors"))
    accum = cfg["train"]["grad_accum_steps"]
    clip = cfg["train"]["clip_grad_norm"]
    params = list(model.parameters())
    # train.precision: autocast around forward and loss; fp16 adds torch.amp.GradScaler.
    precision = cfg["train"].get("precision", "fp32")
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16-mixed" else None
    losses, norms, seconds = [], [], []
    for k in range(steps):
        micro = [(batches[f"step{k}.micro{m}.inputs"], batches[f"step{k}.micro{m}.targets"])
                 for m in range(accum)]
        begin = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for inputs, targets in micro:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                logits = model(inputs)
                loss = models.loss(logits, targets) / accum
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach()
        if scaler:
            scaler.unscale_(optimizer)
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, k)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        losses.append(total.item())
        norms.append(norm.item())
        seconds.append(time.perf_counter() - begin)
    return cfg, losses, norms, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kiln", required=True, help="path to the kiln binary")
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--tolerance", type=float, default=1e-5, help="max relative loss difference")
    parser.add_argument("--timing", action="store_true", help="also time both sides")
    parser.add_argument("--repeats", type=int, default=3, help="timing: alternate kiln/Python this often")
    parser.add_argument("--warmup", type=int, default=3, help="timing: steps left out of the median")
    parser.add_argument("--result", help="write the comparison as JSON here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kiln-peer-") as out:
        kiln = export(args.kiln, args.config, args.steps, out, args.overrides)
        cfg, losses, norms, py_seconds = replay(out, args.steps)
        rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(kiln["loss"], losses)]
        # A NaN on either side is a disagreement (max() would skip a NaN that is not first).
        worst = math.inf if any(math.isnan(r) for r in rel) else max(rel)
        ok = worst <= args.tolerance and len(losses) == len(kiln["loss"]) == args.steps
        for k in range(args.steps):
            print(f"step {k + 1:3d}  kiln {kiln['loss'][k]:.8f}  python {losses[k]:.8f}  rel {rel[k]:.2e}")
        print(f"max relative loss difference {worst:.3e} (tolerance {args.tolerance:g}): "
              f"{'AGREE' if ok else 'DISAGREE'}")
        result = {
            "config": args.config, "overrides": args.overrides, "model": cfg["model"]["name"],
            "steps": args.steps, "tolerance": args.tolerance, "max_relative_loss_difference": worst,
            "agree": ok, "kiln_losses": kiln["loss"], "python_losses": losses,
        }
        if args.timing:
            kiln_medians, py_medians = [], []
            for r in range(args.repeats):
                if r > 0:
                    kiln = export(args.kiln, args.config, args.steps, out, args.overrides)
                    _, _, _, py_seconds = replay(out, args.steps)
                kiln_medians.append(statistics.median(kiln["step_seconds"][args.warmup:]))
                py_medians.append(statistics.median(py_seconds[args.warmup:]))
            k_med, p_med = statistics.median(kiln_medians), statistics.median(py_medians)
            result.update({
                "kiln_median_step_seconds": k_med, "python_median_step_seconds": p_med,
                "ratio_kiln_over_python": k_med / p_med, "repeats": args.repeats,
                "timed_steps_per_repeat": args.steps - args.warmup,
                "batch_size": cfg["train"]["batch_size"], "threads": torch.get_num_threads(),
                "optimizer": cfg["optim"]["name"], "fused": cfg["optim"]["fused"],
                "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            })
            print(f"median step: kiln {1e3 * k_med:.3f} ms, python {1e3 * p_med:.3f} ms, "
                  f"kiln/python = {k_med / p_med:.3f}")
        if args.result:
            with open(args.result, "w") as f:
                json.dump(result, f, indent=2)
                f.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
