#!/usr/bin/env python3
"""kiln's data parallelism against Python's DistributedDataParallel, side by side, same run.

    bench/scale/run.py --kiln build/kiln --config configs/gpt-tiny.toml --world 2 \
                       --result bench/results/scale-gpt-tiny.json

1. `kiln peer export` writes the initial weights and the global batches (per-rank batch x world).
2. Repeated, alternating: `torchrun --nproc-per-node=<world> kiln scale <config>` (kiln's DDP, its
   own loader) and `torchrun --nproc-per-node=<world> bench/scale/ddp_peer.py` (PyTorch DDP, Gloo,
   the same model, weights and shards). Both under torchrun's defaults (OMP_NUM_THREADS=1).
3. Reports the median step time of each side (rank 0, measured steps after warm-up), the ratio
   kiln/Python (lower is better for kiln), and whether the per-step losses agree.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))


FSDP_METHOD = ("; --strategy fsdp: kiln `dist.strategy=fsdp` against FSDP2 (fully_shard per block, "
               "then the root; set_requires_gradient_sync(False) on non-final micro-steps) in "
               "place of DDP, and kiln's DDP once (kiln_ddp) for step time and memory side by side; "
               "kiln memory: scale.json's per-rank parts (tensor bytes, MemoryMeter); python: "
               "peak RSS of rank 0's process (libraries included), a different measure")


def sets(overrides):
    out = []
    for o in overrides:
        out += ["--set", o]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kiln", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="measured steps per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="at least 5: the ratio is a median over them")
    parser.add_argument("--result", help="write the comparison as JSON here")
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp",
                        help="fsdp: kiln's dist.strategy=fsdp against Python FSDP2 (fully_shard), and "
                             "kiln's DDP once for the memory and step time side by side")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor parallelism (a gpt or llama config): kiln dist.tp against "
                             "parallelize_module over a DeviceMesh (ddp_peer.py --tp); --world = --tp")
    parser.add_argument("--replicate", type=int, default=1,
                        help="--strategy fsdp: hybrid sharding with this many replicas: kiln "
                             "dist.dp_replicate against FSDP2 over a 2-D DeviceMesh (replicate, shard)")
    args = parser.parse_args()
    if args.tp > 1 and (args.strategy != "ddp" or args.world != args.tp):
        parser.error("--tp runs alone here: --world = --tp, --strategy ddp")
    if args.replicate > 1 and args.strategy != "fsdp":
        parser.error("--replicate goes with --strategy fsdp")
    if args.world % args.replicate != 0:
        parser.error("--replicate must divide --world")
    if args.repeats < 5:
        parser.error("a ratio needs --repeats 5 or more")

    total = args.warmup + args.steps
    with open(args.config, "rb") as f:
        batch = tomllib.load(f).get("train", {}).get("batch_size", 32)
    for o in args.overrides:
        if o.startswith("train.batch_size="):
            batch = int(o.split("=", 1)[1])
    with tempfile.TemporaryDirectory(prefix="kiln-scale-bench-") as work:
        export = os.path.join(work, "export")
        common = args.overrides + [f"train.steps={max(total, 1)}", "run.progress=off"]
        subprocess.run([args.kiln, "peer", "export", args.config, "--steps", str(total), "--out", export] +
                       sets(common + [f"train.batch_size={batch * args.world // args.tp}", f"run.dir={work}/runs"]),
                       check=True, stdout=subprocess.DEVNULL)
        kiln_medians, py_medians, kiln_losses, py_losses, kiln_runs = [], [], None, None, []
        kiln_cpu, py_cpu = [], []
        for r in range(args.repeats):
            subprocess.run([args.torchrun, "--standalone", f"--nproc-per-node={args.world}", "--no-python",
                            args.kiln, "scale", args.config, "--quiet"] +
                           sets(common + [f"train.batch_size={batch}", f"run.dir={work}/runs", "run.name=kiln",
                                          "dist.scale_baseline_steps=0", f"dist.scale_warmup_steps={args.warmup}",
                                          f"dist.scale_steps={args.steps}", f"dist.strategy={args.strategy}"]
                                          + ([f"dist.dp_replicate={args.replicate}"] if args.strategy == "fsdp" else [])
                                          + ([f"dist.tp={args.tp}"] if args.tp > 1 else [])),
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(os.path.join(work, "runs", "kiln", "scale.json")) as f:
                scale = json.load(f)
            kiln_medians.append(scale["per_rank"][0]["step_seconds"]["median"])
            kiln_cpu.append(scale["per_rank"][0]["cpu_seconds"] / args.steps)
            kiln_losses = scale["losses"]
            kiln_memory = scale["per_rank"][0].get("memory")
            kiln_runs.append({k: scale["global"][k] for k in ("median_step_seconds", "compute_seconds_per_step",
                                                               "comm_busy_seconds_per_step",
                                                               "comm_exposed_seconds_per_step")})
            peer_json = os.path.join(work, "peer.json")
            subprocess.run([args.torchrun, "--standalone", f"--nproc-per-node={args.world}",
                            os.path.join(HERE, "ddp_peer.py"), "--export", export, "--steps", str(total),
                            "--result", peer_json] + (["--fsdp", "--replicate", str(args.replicate)] if args.strategy == "fsdp" else [])
                           + (["--tp", str(args.tp)] if args.tp > 1 else []), check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            with open(peer_json) as f:
                peer = json.load(f)
            py_medians.append(statistics.median(peer["step_seconds"][args.warmup:]))
            py_cpu.append(sum(peer["cpu_seconds"][args.warmup:]) / args.steps)
            py_losses = peer["losses"]
            py_peak_rss = peer.get("peak_rss_bytes")
            print(f"repeat {r + 1}: kiln {1e3 * kiln_medians[-1]:.3f} ms/step "
                  f"({1e3 * kiln_cpu[-1]:.3f} CPU ms), python {1e3 * py_medians[-1]:.3f} ms/step "
                  f"({1e3 * py_cpu[-1]:.3f} CPU ms)", flush=True)

        ddp_side = None
        if args.strategy == "fsdp":  # kiln's DDP once, for the side-by-side figures
            subprocess.run([args.torchrun, "--standalone", f"--nproc-per-node={args.world}", "--no-python",
                            args.kiln, "scale", args.config, "--quiet"] +
                           sets(common + [f"train.batch_size={batch}", f"run.dir={work}/runs", "run.name=kiln-ddp",
                                          "dist.scale_baseline_steps=0", f"dist.scale_warmup_steps={args.warmup}",
                                          f"dist.scale_steps={args.steps}", "dist.strategy=ddp"]),
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(os.path.join(work, "runs", "kiln-ddp", "scale.json")) as f:
                ddp_scale = json.load(f)
            ddp_side = {"median_step_seconds": ddp_scale["per_rank"][0]["step_seconds"]["median"],
                        "memory": ddp_scale["per_rank"][0].get("memory")}

    k_med, p_med = statistics.median(kiln_medians), statistics.median(py_medians)
    peer_name = ("FSDP2" if args.strategy == "fsdp" else "DDP" if args.tp == 1 else "") + (
        f" HSDP {args.replicate}x{args.world // args.replicate}" if args.replicate > 1 else "") + (
        f"TP {args.tp} (parallelize_module)" if args.tp > 1 else "")
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(kiln_losses, py_losses))
    result = {
        "config": args.config, "overrides": args.overrides, "world_size": args.world,
        "batch_size_per_rank": batch, "warmup_steps": args.warmup, "measured_steps": args.steps,
        "repeats": args.repeats, "backend": "gloo",
        "kiln_median_step_seconds": k_med, "python_median_step_seconds": p_med,
        "ratio_kiln_over_python": k_med / p_med, "target_ratio": 0.9,
        "kiln_best_repeat_step_seconds": min(kiln_medians), "python_best_repeat_step_seconds": min(py_medians),
        "best_repeat_ratio_kiln_over_python": min(kiln_medians) / min(py_medians),
        "kiln_medians_per_repeat": kiln_medians, "python_medians_per_repeat": py_medians,
        "kiln_cpu_seconds_per_step": statistics.median(kiln_cpu),
        "python_cpu_seconds_per_step": statistics.median(py_cpu),
        "cpu_ratio_kiln_over_python": statistics.median(kiln_cpu) / statistics.median(py_cpu),
        "kiln_cpu_per_repeat": kiln_cpu, "python_cpu_per_repeat": py_cpu,
        "kiln_breakdown_per_repeat": kiln_runs,
        "losses_max_relative_difference": worst,
        "strategy": args.strategy, "replicas": args.replicate, "tp": args.tp,
        "kiln_memory_rank0": kiln_memory, "kiln_ddp": ddp_side,
        "python_peak_rss_bytes_rank0": py_peak_rss,
        "fsdp_over_ddp_step": (k_med / ddp_side["median_step_seconds"]) if ddp_side else None,
        "fsdp_over_ddp_model_state": (kiln_memory["model_state"] / ddp_side["memory"]["model_state"])
        if ddp_side and kiln_memory and ddp_side["memory"] else None,
        "kiln_losses": kiln_losses, "python_losses": py_losses,
        "method": "both under torchrun --standalone (OMP_NUM_THREADS=1 per rank), alternating; kiln: "
                  "`kiln scale` (its loader threads, bucketed all-reduce from autograd hooks); python: "
                  "DistributedDataParallel(bucket_cap_mb=dist.bucket_mb) on the same weights and "
                  "shards, preloaded in memory; step time = rank 0's median over the measured steps; "
                  "CPU time = rank 0's process CPU time (every thread) over the measured steps / steps, "
                  "less sensitive than wall time to other jobs on a shared machine" + FSDP_METHOD
                  * (args.strategy == "fsdp"),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(f"median step: kiln {1e3 * k_med:.3f} ms, python {peer_name} {1e3 * p_med:.3f} ms, "
          f"kiln/python = {k_med / p_med:.3f} (target <= 0.9); CPU time per step (rank 0, all "
          f"threads) kiln/python = {result['cpu_ratio_kiln_over_python']:.3f}; best repeats "
          f"kiln/python = {result['best_repeat_ratio_kiln_over_python']:.3f}; losses agree to {worst:.1e}")
    if args.result:
        with open(args.result, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
