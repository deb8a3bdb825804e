#!/usr/bin/env python3
"""The production step, kiln against Python: bf16-mixed, activation checkpointing per block, FSDP at
2 ranks, each block compiled; side by side, same run.

    .venv/bin/python bench/compile/fsdp.py --kiln build/kiln --config configs/gpt-tiny.toml \
        --batch 8 --repeats 5 --result bench/results/compile-fsdp-ac-bf16-gpt-tiny.json

1. `kiln peer export` writes the resolved config, the initial weights and the global batches
   (per-rank batch x world).
2. Repeated, alternating, both under `torchrun --standalone --nproc-per-node=<world>` (its default
   OMP_NUM_THREADS=1 per rank):
   kiln: `kiln train` with dist.strategy = fsdp, train.activation_checkpointing = block,
       train.precision = bf16-mixed, compile.backend = inductor, compile.granularity = unit (each
       block an AOTInductor forward and backward package, inside FSDP's gather/free and the
       checkpointing); its own loader; one package cache for all repeats (the first builds it);
   Python: bench/scale/ddp_peer.py --fsdp --checkpoint --compile-units --bf16: FSDP2 (fully_shard
       per block, then the root), checkpoint_wrapper per block, torch.compile per block,
       MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) and autocast(cpu, bf16), on the
       same weights and per-rank shards, preloaded.
   Each rank runs under bench/compile/peak_rss.py, which records that process's own peak resident
   set (VmHWM; compiler subprocesses not counted), the same measure on both sides.
3. Step time: rank 0's median over the steps after --warmup of each repeat (the first steps hold
   the package load or torch.compile's compile); the ratio kiln/Python of the medians over the
   repeats (lower is faster for kiln), every repeat's numbers kept, with the 1-minute load average
   before each side, and the per-step losses of the two sides compared.
"""
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from run import bench_parser, cpu_flags, parse_bench_args, sets, write_result  # noqa: E402  (the single-process compile bench's helpers)

PRODUCTION = ["dist.strategy=fsdp", "train.activation_checkpointing=block", "train.precision=bf16-mixed"]


def peaks(directory, world):
    out = []
    for r in range(world):
        with open(os.path.join(directory, f"rank{r}.json")) as f:
            out.append(json.load(f)["peak_rss_bytes"])
    return out


def main():
    parser = bench_parser(__doc__, warmup=3, steps=6)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, required=True, help="samples per rank per step")
    parser.add_argument("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    parser.add_argument("--cache", help="kiln's package cache (default: a fresh one, built by the first repeat)")
    args = parse_bench_args(parser)

    total = args.warmup + args.steps
    common = args.overrides + PRODUCTION + [f"train.steps={total}", "run.progress=off",
                                           "train.eval_every=0", "train.eval_batches=1"]
    launch = [args.torchrun, "--standalone", f"--nproc-per-node={args.world}"]
    wrap = os.path.join(HERE, "peak_rss.py")
    repeats = []
    with tempfile.TemporaryDirectory(prefix="kiln-compile-fsdp-bench-") as work:
        export = os.path.join(work, "export")
        subprocess.run([args.kiln, "peer", "export", args.config, "--steps", str(total), "--out", export] +
                       sets(common + [f"train.batch_size={args.batch * args.world}", f"run.dir={work}/runs"]),
                       check=True, stdout=subprocess.DEVNULL)
        cache = args.cache or os.path.join(work, "cache")
        for r in range(args.repeats):
            rep = {"load_average_1min": {"before_kiln": os.getloadavg()[0]}}
            name = f"kiln{r}"
            begin = time.perf_counter()
            subprocess.run(launch + [wrap, "--out", os.path.join(work, f"rss-{name}"), "--", args.kiln, "train",
                                     args.config] +
                           sets(common + [f"train.batch_size={args.batch}", f"run.dir={work}/runs",
                                          f"run.name={name}", "compile.backend=inductor",
                                          "compile.granularity=unit", f"compile.cache_dir={cache}"]),
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rep["kiln_wall_seconds"] = time.perf_counter() - begin
            with open(os.path.join(work, "runs", name, "metrics.jsonl")) as f:
                records = [json.loads(line) for line in f if line.strip()]
            records = [x for x in records if "step_seconds" in x]
            rep["kiln_step_seconds"] = [x["step_seconds"] for x in records]
            rep["kiln_data_wait_seconds"] = [x["data_wait_seconds"] for x in records]
            rep["kiln_losses"] = [x["loss"] for x in records]
            rep["kiln_peak_rss_bytes_per_rank"] = peaks(os.path.join(work, f"rss-{name}"), args.world)

            rep["load_average_1min"]["before_python"] = os.getloadavg()[0]
            peer_json = os.path.join(work, f"peer{r}.json")
            begin = time.perf_counter()
            subprocess.run(launch + [wrap, "--out", os.path.join(work, f"rss-peer{r}"), "--", sys.executable,
                                     os.path.join(ROOT, "bench", "scale", "ddp_peer.py"), "--export", export,
                                     "--steps", str(total), "--result", peer_json, "--fsdp", "--checkpoint",
                                     "--compile-units", "--bf16"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rep["python_wall_seconds"] = time.perf_counter() - begin
            with open(peer_json) as f:
                peer = json.load(f)
            rep["python_step_seconds"] = peer["step_seconds"]
            rep["python_losses"] = peer["losses"]
            rep["python_peak_rss_bytes_per_rank"] = peaks(os.path.join(work, f"rss-peer{r}"), args.world)
            rep["load_average_1min"]["after_python"] = os.getloadavg()[0]

            rep["kiln_median_step_seconds"] = statistics.median(rep["kiln_step_seconds"][args.warmup:])
            rep["python_median_step_seconds"] = statistics.median(rep["python_step_seconds"][args.warmup:])
            rep["ratio_kiln_over_python"] = rep["kiln_median_step_seconds"] / rep["python_median_step_seconds"]
            repeats.append(rep)
            print(f"repeat {r + 1}: kiln {1e3 * rep['kiln_median_step_seconds']:.1f} ms/step, python "
                  f"{1e3 * rep['python_median_step_seconds']:.1f} ms/step, ratio "
                  f"{rep['ratio_kiln_over_python']:.3f}; peak RSS per rank kiln "
                  f"{[b >> 20 for b in rep['kiln_peak_rss_bytes_per_rank']]} MiB, python "
                  f"{[b >> 20 for b in rep['python_peak_rss_bytes_per_rank']]} MiB; load "
                  f"{rep['load_average_1min']}", flush=True)

    med = statistics.median
    k_med = med(r["kiln_median_step_seconds"] for r in repeats)
    p_med = med(r["python_median_step_seconds"] for r in repeats)
    worst = max(abs(a - b) / abs(b) for r in repeats for a, b in zip(r["kiln_losses"], r["python_losses"]))
    k_rss = [med(r["kiln_peak_rss_bytes_per_rank"][i] for r in repeats) for i in range(args.world)]
    p_rss = [med(r["python_peak_rss_bytes_per_rank"][i] for r in repeats) for i in range(args.world)]
    result = {
        "config": args.config, "overrides": args.overrides + PRODUCTION, "world_size": args.world,
        "batch_size_per_rank": args.batch, "warmup_steps": args.warmup, "timed_steps": args.steps,
        "repeats": args.repeats, "backend": "gloo", "threads_per_rank": 1,
        "kiln_median_step_seconds": k_med, "python_median_step_seconds": p_med,
        "ratio_kiln_over_python": k_med / p_med, "target_ratio": 1.0,
        "ratios_per_repeat": [r["ratio_kiln_over_python"] for r in repeats],
        # Each repeat's ratio pairs two runs a minute apart: steadier than the ratio of medians
        # on a shared, loaded machine.
        "median_of_repeat_ratios": med(r["ratio_kiln_over_python"] for r in repeats),
        "kiln_peak_rss_bytes_per_rank": k_rss, "python_peak_rss_bytes_per_rank": p_rss,
        "peak_rss_ratio_kiln_over_python_per_rank": [k / p for k, p in zip(k_rss, p_rss)],
        "losses_max_relative_difference": worst,
        "repeats_detail": repeats,
        "method": __doc__.split("\n\n", 2)[2].strip(),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "cpu_flags": cpu_flags(),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(f"median step: kiln {1e3 * k_med:.1f} ms, python FSDP2 {1e3 * p_med:.1f} ms, kiln/python = "
          f"{k_med / p_med:.3f} (repeats {[round(r['ratio_kiln_over_python'], 3) for r in repeats]}); peak RSS "
          f"per rank kiln {[b >> 20 for b in k_rss]} MiB, python {[b >> 20 for b in p_rss]} MiB; losses "
          f"agree to {worst:.1e}")
    write_result(args.result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
