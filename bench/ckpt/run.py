#!/usr/bin/env python3
"""Checkpoint benchmark, measured side by side in one run.

1. Save and load throughput of a >= 500 MB float32 state (kiln_ckpt_bench save-load: sync save =
   write + fsync + commit; load = read + xxh3 verify, page cache evicted first) against the disk's
   own sequential write speed (dd ... conv=fsync, measured before and after) and against Python
   torch.distributed.checkpoint saving and loading the very same tensors (sync_files=True), in
   interleaved rounds (dd, kiln, DCP back to back); medians over the rounds.
2. What a save costs training on the gpt `small` state, sync against async (kiln_ckpt_bench
   stall): the time the training thread is blocked, plus the slowdown of the steps that run while
   a background save writes (against the step time without checkpointing).

Threads, stated: kiln writes each rank's file from one writer thread and DCP's FileSystemWriter
runs with thread_count=1 (its default): equal. kiln's reader issues its reads from 4 threads
(src/ckpt/load.cpp, fixed); DCP's FileSystemReader has no thread setting in this torch and reads
from one: the load ratio compares both at their defaults.

Writes bench/results/ckpt-save-load.json and bench/results/ckpt-async-stall.json.

    .venv/bin/python bench/ckpt/run.py [--build build] [--dir /tmp/kiln-ckpt-bench] [--megabytes 512]
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def evict(path: Path):
    """Drops a directory's or file's clean pages from the page cache (reads then come from disk)."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd_write(directory: Path, megabytes: int, repeats: int):
    """Sequential write of megabytes MiB-ish with one fsync at the end, as dd measures a disk."""
    out = directory / "dd.bin"
    block = 16 << 20
    count = max(1, (megabytes * 1000 * 1000 + block - 1) // block)
    speeds = []
    for _ in range(repeats):
        out.unlink(missing_ok=True)
        begin = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={out}", f"bs={block}", f"count={count}", "conv=fsync"],
                       check=True, capture_output=True)
        speeds.append(count * block / (time.perf_counter() - begin))
    out.unlink(missing_ok=True)
    return speeds


def raw_write(directory: Path, megabytes: int):
    """The same sequential write from a program: megabytes of distinct memory (as a state is) in
    16 MiB write() calls, then fsync."""
    out = directory / "raw.bin"
    block = 16 << 20
    count = max(1, (megabytes * 1000 * 1000 + block - 1) // block)
    data = memoryview(os.urandom(block) * count)
    begin = time.perf_counter()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for k in range(count):
            view = data[k * block:(k + 1) * block]
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    speed = count * block / (time.perf_counter() - begin)
    out.unlink()
    return speed


def dcp_save_load(tensors: dict, directory: Path, repeats: int):
    save_seconds, load_seconds = [], []
    for _ in range(repeats):
        shutil.rmtree(directory, ignore_errors=True)
        begin = time.perf_counter()
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True))
        save_seconds.append(time.perf_counter() - begin)
    file_bytes = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    for _ in range(repeats):
        target = {k: torch.empty_like(v) for k, v in tensors.items()}
        evict(directory)
        begin = time.perf_counter()
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(directory)))
        load_seconds.append(time.perf_counter() - begin)
    assert all(torch.equal(target[k], v) for k, v in tensors.items()), "DCP load differs"
    return save_seconds, load_seconds, file_bytes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=str(ROOT / "build"))
    parser.add_argument("--dir", default="/tmp/kiln-ckpt-bench")
    parser.add_argument("--megabytes", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stall-saves", type=int, default=5)
    parser.add_argument("--steps-between-saves", type=int, default=3)
    parser.add_argument("--stall-batch-size", type=int, default=4,
                        help="gpt small's batch in the stall run: short steps keep their noise "
                             "below a save's cost (the state, 130 MB, does not depend on it)")
    parser.add_argument("--skip-stall", action="store_true")
    args = parser.parse_args()
    if args.repeats < 5 or args.stall_saves < 5:
        parser.error("a ratio needs --repeats 5 or more and --stall-saves 5 or more")
    bench = Path(args.build) / "bench" / "ckpt" / "kiln_ckpt_bench"
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(work)], capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "filesystem": fs, "directory": str(work),
               "torch": torch.__version__, "git_commit": commit,
               "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    # Interleaved rounds (dd, kiln, DCP back to back) so a noisy shared disk affects all three alike.
    dd_speeds, raw_speeds, kiln_save_s, kiln_load_s, dcp_save_s, dcp_load_s = [], [], [], [], [], []
    tensors, kiln, dcp_bytes = None, None, 0
    load_averages = []
    for round_ in range(args.repeats):
        load_averages.append({"before": os.getloadavg()})
        dd_speeds += dd_write(work, args.megabytes, 1)
        raw_speeds.append(raw_write(work, args.megabytes))
        shutil.rmtree(work / "kiln", ignore_errors=True)
        kiln = json.loads(subprocess.run([str(bench), "save-load", str(work / "kiln"), str(args.megabytes), "1"],
                                         check=True, capture_output=True, text=True).stdout)
        kiln_save_s += kiln["save_seconds"]
        kiln_load_s += kiln["load_seconds"]
        if tensors is None:
            tensors = load_file(Path(kiln["checkpoint"]) / "rank-0.safetensors")
        save_s, load_s, dcp_bytes = dcp_save_load(tensors, work / "dcp", 1)
        shutil.rmtree(work / "dcp", ignore_errors=True)
        dcp_save_s += save_s
        dcp_load_s += load_s
        load_averages[-1]["after"] = os.getloadavg()
        print(f"round {round_}: dd {dd_speeds[-1] / 1e6:.0f} MB/s, raw {raw_speeds[-1] / 1e6:.0f} MB/s | kiln save {kiln_save_s[-1]:.2f}s load "
              f"{kiln_load_s[-1]:.2f}s | DCP save {dcp_save_s[-1]:.2f}s load {dcp_load_s[-1]:.2f}s | load "
              f"{load_averages[-1]['before'][0]:.1f} -> {load_averages[-1]['after'][0]:.1f}", flush=True)
    del tensors
    kiln["save_seconds"], kiln["load_seconds"] = kiln_save_s, kiln_load_s
    kiln["save_bytes_per_second"] = kiln["file_bytes"] / statistics.median(kiln_save_s)
    kiln["load_bytes_per_second"] = kiln["file_bytes"] / statistics.median(kiln_load_s)
    dcp_save, dcp_load = dcp_save_s, dcp_load_s

    # The disk's speed: the faster of dd and the plain writer (the stricter reference for kiln).
    disk = max(statistics.median(dd_speeds), statistics.median(raw_speeds))
    kiln_save = kiln["save_bytes_per_second"]
    kiln_load = kiln["load_bytes_per_second"]
    dcp_save_speed = dcp_bytes / statistics.median(dcp_save)
    dcp_load_speed = dcp_bytes / statistics.median(dcp_load)
    save_load = {
        "machine": machine,
        "state_bytes": kiln["state_bytes"],
        "load_average_1_5_15_per_round": load_averages,
        "tensors": kiln["tensors"],
        "disk_sequential_write_bytes_per_second": {
            "dd_conv_fsync_rounds": dd_speeds, "dd_median": statistics.median(dd_speeds),
            "plain_writer_fsync_rounds": raw_speeds, "plain_writer_median": statistics.median(raw_speeds),
            "reference": disk, "reference_is": "the faster of the two medians"},
        "kiln": kiln,
        "dcp": {"save_seconds": dcp_save, "load_seconds": dcp_load, "file_bytes": dcp_bytes,
                "save_bytes_per_second": dcp_save_speed, "load_bytes_per_second": dcp_load_speed,
                "writer": "FileSystemWriter(sync_files=True), defaults (thread_count=1, one file per rank)",
                "reader": "FileSystemReader, defaults (no thread setting: one thread)"},
        "threads": {"save": "equal: kiln one writer thread per rank, DCP thread_count=1",
                    "load": "both at their defaults: kiln 4 reader threads (fixed), DCP 1 (no setting)"},
        "ratios": {
            "kiln_save_over_disk": kiln_save / disk,
            "kiln_save_over_dcp_save": kiln_save / dcp_save_speed,
            "kiln_load_over_dcp_load": kiln_load / dcp_load_speed,
        },
        "targets": {"kiln_save_over_disk": ">= 0.7", "kiln_save_over_dcp_save": "> 1"},
        "notes": "kiln save = write + fsync of the file + index.json + directory renames and fsyncs; "
                 "kiln load verifies every file's xxh3; loads start from evicted pages (posix_fadvise DONTNEED).",
    }
    (results / "ckpt-save-load.json").write_text(json.dumps(save_load, indent=2) + "\n")
    print(json.dumps(save_load["ratios"], indent=2), flush=True)

    if not args.skip_stall:
        before = os.getloadavg()
        out = subprocess.run([str(bench), "stall", str(ROOT / "configs" / "gpt-small.toml"), str(work / "stall"),
                              str(args.stall_saves), str(args.steps_between_saves),
                              f"train.batch_size={args.stall_batch_size}"],
                             check=True, capture_output=True, text=True)
        stall = json.loads(out.stdout.strip().splitlines()[-1])
        stall["machine"] = machine
        stall["load_average_1_5_15"] = {"before": before, "after": os.getloadavg()}
        stall["target"] = "async cost (blocked + slowed steps) <= 10% of the sync save's"
        (results / "ckpt-async-stall.json").write_text(json.dumps(stall, indent=2) + "\n")
        for mode in ("async_staging_in_save", "async"):
            print(f"sync save {stall['sync']['median_steady_cost_seconds']:.3f}s, {mode}: blocked "
                  f"{stall[mode]['median_steady_stall_seconds']:.4f}s + slowed steps, cost "
                  f"{stall[mode]['median_steady_cost_seconds']:.4f}s: ratio {stall[mode + '_cost_over_sync_save']:.3f} "
                  f"(blocking only {stall[mode + '_blocking_stall_over_sync_save']:.3f})", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
