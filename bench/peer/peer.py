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

Under train.precision = "fp16-mixed" both sides scale the loss (kiln's scaler, torch.amp.GradScaler
on this side) and the steps each skips on a gradient overflow and the scale after every step
must be equal too; --initial-loss-scale starts both scalers there (one so large that the first
steps overflow), --min-skipped requires that many skipped steps, so the skip path really ran.

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

def export(kiln, config, steps, out, overrides, initial_loss_scale=None):
    cmd = [kiln, "peer", "export", config, "--steps", str(steps), "--out", out]
    if initial_loss_scale:
        cmd += ["--initial-loss-scale", repr(initial_loss_scale)]
    for o in overrides:
        cmd += ["--set", o]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "kiln.json")) as f:
        return json.load(f)


def replay(out, steps, initial_loss_scale=None):
    """Returns (config, losses, grad norms, step seconds, skipped, loss scales): skipped[k] says
    whether step k left the optimizer unstepped; loss scales are None without a scaler."""
    with open(os.path.join(out, "config.toml"), "rb") as f:
        cfg = tomllib.load(f)
    if cfg["run"]["threads"] > 0:
        torch.set_num_threads(cfg["run"]["threads"])
    if cfg["run"]["deterministic"]:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # As kiln: the fill of new tensors' memory only when run.fill_uninitialized_memory.
        torch.utils.deterministic.fill_uninitialized_memory = bool(
            cfg["run"].get("fill_uninitialized_memory", True))
    initial = load_file(os.path.join(out, "init.safetensors"))
    if cfg["model"]["name"] == "exported":
        # A package `kiln model import` wrote: the original module (a Python factory's, or a
        # Hugging Face model's), eager, with kiln's initial weights. The package's graph holds a
        # tied weight once; the module's other name for it shares the loaded tensor.
        from kiln_py import export_model
        model = export_model.source_module(cfg["model"]["package"])
        result = model.load_state_dict(initial, strict=False)
        tied = {n for n, _ in model.named_parameters()}  # named_parameters lists a tied one once
        missing = [k for k in result.missing_keys if k in tied]
        if missing or result.unexpected_keys:
            raise SystemExit(f"the package's weights do not fit its source module: missing "
                             f"{missing}, unexpected {result.unexpected_keys}")
    else:
        model = models.from_config(cfg["model"])
        model.load_state_dict(initial, strict=True)
    model.train()
    optimizer = make_optimizer(model, cfg["optim"])
    batches = load_file(os.path.join(out, "batches.safetensors"))
    accum = cfg["train"]["grad_accum_steps"]
    clip = cfg["train"]["clip_grad_norm"]
    params = list(model.parameters())
    # train.precision: autocast around forward and loss; fp16 adds torch.amp.GradScaler.
    precision = cfg["train"].get("precision", "fp32")
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    scaler = None
    if precision == "fp16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=initial_loss_scale or 2.0**16)
    losses, norms, seconds, skipped, scales = [], [], [], [], []
    for k in range(steps):
        micro = [(batches[f"step{k}.micro{m}.inputs"], batches[f"step{k}.micro{m}.targets"])
                 for m in range(accum)]
        # A skipped step leaves every parameter as it was (the fused AdamW that GradScaler.step
        # hands found_inf to still runs step(), as a no-op).
        before = [p.detach().clone() for p in params] if scaler else None
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
        skipped.append(scaler is not None and all(torch.equal(a, p) for a, p in zip(before, params)))
        scales.append(scaler.get_scale() if scaler else None)
    return cfg, losses, norms, seconds, skipped, scales


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kiln", required=True, help="path to the kiln binary")
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--tolerance", type=float, default=1e-5, help="max relative loss difference")
    parser.add_argument("--agree-steps", type=int,
                        help="judge agreement over the first N steps only (default: every step); the "
                             "difference over every step is recorded beside it as drift")
    parser.add_argument("--timing", action="store_true", help="also time both sides")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timing: alternate kiln/Python this often (at least 5)")
    parser.add_argument("--warmup", type=int, default=3, help="timing: steps left out of the median")
    parser.add_argument("--result", help="write the comparison as JSON here")
    parser.add_argument("--initial-loss-scale", type=float,
                        help="fp16-mixed: both loss scalers start at this scale (default 65536)")
    parser.add_argument("--min-skipped", type=int, default=0,
                        help="require at least this many steps skipped (on both sides)")
    args = parser.parse_args()
    if args.timing and args.repeats < 5:
        parser.error("--timing claims a ratio: use --repeats 5 or more")

    with tempfile.TemporaryDirectory(prefix="kiln-peer-") as out:
        kiln = export(args.kiln, args.config, args.steps, out, args.overrides,
                      args.initial_loss_scale)
        cfg, losses, norms, py_seconds, py_skipped, py_scales = replay(
            out, args.steps, args.initial_loss_scale)
        rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(kiln["loss"], losses)]
        # A NaN on either side is a disagreement (max() would skip a NaN that is not first).
        def largest(values):
            return math.inf if any(math.isnan(r) for r in values) else max(values)
        worst = largest(rel)
        window = min(args.agree_steps or args.steps, args.steps)
        worst_in_window = largest(rel[:window])
        first_differing = next((k + 1 for k, r in enumerate(rel) if r != 0), None)
        ok = worst_in_window <= args.tolerance and len(losses) == len(kiln["loss"]) == args.steps
        # Skipped steps and the loss scale (powers of two: exactly equal or not at all).
        same_skips = kiln["skipped"] == py_skipped
        same_scales = kiln["loss_scale"] == py_scales
        enough_skips = sum(py_skipped) >= args.min_skipped
        ok = ok and same_skips and same_scales and enough_skips
        for k in range(args.steps):
            line = f"step {k + 1:3d}  kiln {kiln['loss'][k]:.8f}  python {losses[k]:.8f}  rel {rel[k]:.2e}"
            if py_scales[k] is not None or kiln["skipped"][k] or py_skipped[k]:
                line += (f"  skipped kiln {kiln['skipped'][k]!s:5} python {py_skipped[k]!s:5}"
                         f"  scale kiln {kiln['loss_scale'][k]} python {py_scales[k]}")
            print(line)
        if not same_skips:
            print("the skipped steps differ")
        if not same_scales:
            print("the loss scales differ")
        if not enough_skips:
            print(f"{sum(py_skipped)} step(s) skipped, fewer than --min-skipped {args.min_skipped}")
        if window < args.steps:
            print(f"over all {args.steps} steps (drift, not judged): max relative loss difference "
                  f"{worst:.3e}; the losses first differ at step {first_differing}")
        print(f"max relative loss difference {worst_in_window:.3e} over {window} steps (tolerance "
              f"{args.tolerance:g}), {sum(py_skipped)} step(s) skipped: {'AGREE' if ok else 'DISAGREE'}")
        result = {
            "config": args.config, "overrides": args.overrides, "model": cfg["model"]["name"],
            "steps": args.steps, "tolerance": args.tolerance, "agree_steps": window,
            "max_relative_loss_difference_agree_steps": worst_in_window,
            "max_relative_loss_difference": worst, "first_differing_step": first_differing,
            "agree": ok, "kiln_losses": kiln["loss"], "python_losses": losses,
            "kiln_skipped": kiln["skipped"], "python_skipped": py_skipped,
            "kiln_loss_scales": kiln["loss_scale"], "python_loss_scales": py_scales,
        }
        if args.timing:
            kiln_medians, py_medians, load_averages = [], [], []
            for r in range(args.repeats):
                load_averages.append({"before": os.getloadavg()})
                if r > 0:
                    kiln = export(args.kiln, args.config, args.steps, out, args.overrides,
                                  args.initial_loss_scale)
                    py_seconds = replay(out, args.steps, args.initial_loss_scale)[3]
                kiln_medians.append(statistics.median(kiln["step_seconds"][args.warmup:]))
                py_medians.append(statistics.median(py_seconds[args.warmup:]))
                load_averages[-1]["after"] = os.getloadavg()
                print(f"repeat {r}: kiln {1e3 * kiln_medians[-1]:.3f} ms, python "
                      f"{1e3 * py_medians[-1]:.3f} ms, load {load_averages[-1]['before'][0]:.1f} -> "
                      f"{load_averages[-1]['after'][0]:.1f}", flush=True)
            k_med, p_med = statistics.median(kiln_medians), statistics.median(py_medians)
            result.update({
                "kiln_median_step_seconds": k_med, "python_median_step_seconds": p_med,
                "ratio_kiln_over_python": k_med / p_med, "repeats": args.repeats,
                "kiln_median_step_seconds_per_repeat": kiln_medians,
                "python_median_step_seconds_per_repeat": py_medians,
                "ratio_kiln_over_python_per_repeat": [k / p for k, p in zip(kiln_medians, py_medians)],
                "timed_steps_per_repeat": args.steps - args.warmup,
                "load_average_1_5_15_per_repeat": load_averages,
                "same_work": "both sides replay the same exported batches, preloaded in memory "
                             "(kiln: Trainer::train_step_on; no loader on either side)",
                "batch_size": cfg["train"]["batch_size"], "seq_len": cfg["data"].get("seq_len"),
                "precision": cfg["train"].get("precision", "fp32"), "threads": torch.get_num_threads(),
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
