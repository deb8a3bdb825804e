#!/usr/bin/env python3
"""Checkpoints across real processes and world sizes (docs/checkpoint.md): ranks started by
torchrun write their files in parallel; a checkpoint saved at world size N resumes at world size M.

    reshard_cases.py --kiln build/kiln --torchrun .venv/bin/torchrun --source .

Both directions share one reference, a single-process run of the same global batch straight
through TOTAL steps: its own step-SAVE_AT checkpoint is the one-process save that two ranks
resume (1 -> 2), and two ranks save at SAVE_AT for one process to resume (2 -> 1). Each resumed
run must continue as the reference did: per-step losses and the parameters at the save step agree
to 1e-5 (DDP's documented equivalence; the order of fp32 sums differs between 1 and 2 ranks, so
not bitwise).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dist"))
from dist_cases import CHECKS, MLP, base_env, check, metrics, relative, run, sets  # noqa: E402

SAVE_AT, TOTAL, GLOBAL_BATCH = 6, 10, 32


def train(args, nproc, run_dir, overrides, extra=()):
    cfg = os.path.join(args.source, "configs/mlp.toml")
    common = MLP + [f"run.dir={run_dir}", "run.name=job", f"train.steps={TOTAL}",
                    f"train.batch_size={GLOBAL_BATCH // nproc}", "checkpoint.every_steps=3",
                    "checkpoint.drill=false"]
    cmd = [args.kiln, "train", cfg] + sets(common + overrides) + list(extra)
    if nproc > 1:
        cmd = [args.torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python"] + cmd
    rc, _, err, _ = run(cmd)
    return rc, err


def losses(run_dir):
    return {m["step"]: m["loss"] for m in metrics(os.path.join(run_dir, "job")) if "loss" in m}


def consolidated(args, ckpt, out):
    rc, _, err, _ = run([args.kiln, "ckpt", "consolidate", ckpt, out])
    check(rc == 0, f"consolidate {os.path.basename(ckpt)} (exit {rc})") or print(err)
    return load_file(out)


def checked_checkpoint(args, ckpt, world):
    with open(os.path.join(ckpt, "index.json")) as f:
        index = json.load(f)
    check(index["world_size"] == world, f"index.json records world size {world}")
    rank_files = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    check(len(rank_files) == world, f"one file per rank: {rank_files}")
    rc, _, err, _ = run([args.kiln, "ckpt", "verify", ckpt])
    check(rc == 0, f"kiln ckpt verify passes (exit {rc})") or print(err)


def resumed_matches(args, work, name, ckpt, resume_world, reference):
    resumed_dir = os.path.join(work, name)
    rc, err = train(args, resume_world, resumed_dir, [], ["--resume", ckpt])
    check(rc == 0, f"{name}: {resume_world} process(es) resume from step {SAVE_AT} (exit {rc})") \
        or print(err)
    resumed = losses(resumed_dir)
    steps = list(range(SAVE_AT + 1, TOTAL + 1))
    check(all(s in resumed for s in steps) and min(resumed) == SAVE_AT + 1,
          f"{name}: the resumed run logged steps {SAVE_AT + 1}..{TOTAL} only")
    worst = max(relative(resumed[s], reference[s]) for s in steps)
    check(worst <= 1e-5, f"{name}: losses after the resume match the uninterrupted run: "
                         f"max relative {worst:.2e}")


def reshard_both_ways(args, work):
    reference_dir, saved_dir = os.path.join(work, "reference"), os.path.join(work, "saved")
    # One process straight through (checkpoints every 3 steps), and two ranks that stop at
    # SAVE_AT as if preempted.
    rc, err = train(args, 1, reference_dir, [])
    check(rc == 0, f"reference: 1 process, {TOTAL} uninterrupted steps (exit {rc})") or print(err)
    rc, err = train(args, 2, saved_dir, [f"train.steps={SAVE_AT}"])
    check(rc == 0, f"2 processes train {SAVE_AT} steps with checkpoints (exit {rc})") or print(err)
    one_rank = os.path.join(reference_dir, "job", "checkpoints", f"step-{SAVE_AT}")
    two_ranks = os.path.join(saved_dir, "job", "checkpoints", f"step-{SAVE_AT}")
    checked_checkpoint(args, one_rank, 1)
    checked_checkpoint(args, two_ranks, 2)
    reference = losses(reference_dir)
    resumed_matches(args, work, "two_to_one", two_ranks, 1, reference)
    resumed_matches(args, work, "one_to_two", one_rank, 2, reference)
    a = consolidated(args, two_ranks, os.path.join(work, "saved.safetensors"))
    b = consolidated(args, one_rank, os.path.join(work, "reference.safetensors"))
    worst = max(float(np.max(np.abs(a[k] - b[k])) / max(float(np.max(np.abs(b[k]))), 1e-12)) for k in b)
    check(set(a) == set(b) and worst <= 1e-5,
          f"parameters at step {SAVE_AT}, 2 ranks vs 1: max relative {worst:.2e}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kiln", required=True)
    parser.add_argument("--torchrun", required=True)
    parser.add_argument("--source", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-reshard-") as work:
        reshard_both_ways(args, work)
    failed = [what for ok, what in CHECKS if not ok]
    print(f"{len(CHECKS) - len(failed)}/{len(CHECKS)} checks held")
    return 1 if failed or not CHECKS else 0


if __name__ == "__main__":
    sys.exit(main())
