#!/usr/bin/env python3
"""The plan's projected step time for the machine the pilot ran on, beside the baseline rung's
measured step time, same run.

    .venv/bin/python bench/plan/run.py --kiln build/kiln --config configs/gpt-tiny.toml \
        --set run.threads=2 --result bench/results/plan-gpt-tiny.json

1. This CPU's fp32 matmul peak, measured (torch.mm of 2048 x 2048 float32 at the run's thread
   count, best of 5): the catalog has no row for a development CPU, so the script writes one
   (plan.catalog, `match = ["CPU"]`, peak_tflops from that measurement) into its work directory.
2. `kiln pilot CONFIG` (the production shape, one measured optimizer step: MFU from the row's
   peak), then `kiln baseline CONFIG` (the steady-state median over baseline.steps).
3. `kiln plan CONFIG --pilot RUN` restricted to that row at plan.gpus = 1 (one process, as the
   pilot and the baseline ran): its step_seconds is the projection.
Repeated --repeats times; the result holds every repeat and the median ratio
projected / measured (1.0 = the plan predicts the steady-state step; above 1 it overestimates).
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

import torch


def sets(overrides):
    out = []
    for o in overrides:
        out += ["--set", o]
    return out


def measured_peak_flops(threads, n=2048, repeats=5):
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - began)
    return 2.0 * n ** 3 / best


def write_catalog(path, peak, memory_bytes):
    tflops = peak / 1e12
    with open(path, "w") as f:
        f.write(f"""# Written by bench/plan/run.py: this development CPU, its fp32 peak measured.
[device.this-cpu]
display_name = "{platform.processor() or platform.machine()} (this machine's CPU)"
match = ["CPU"]
memory_gb = {memory_bytes / 1e9:.1f}
memory_bandwidth_gb_per_s = 10
interconnect = "none (one process)"
interconnect_gb_per_s = 10
gpus_per_node = 1
network_gb_per_s = 1
peak_tflops = {{ fp32 = {tflops:.6f}, tf32 = {tflops:.6f}, bf16 = {tflops:.6f}, fp16 = {tflops:.6f} }}
source = "torch.mm 2048x2048 float32, best of 5, measured by bench/plan/run.py"
date = "{time.strftime('%Y-%m')}"
""")


def kiln(args, command, extra, name):
    cmd = [args.kiln, command, args.config] + extra + sets(args.set + [
        f"run.dir={args.work}/runs", f"run.name={name}", "run.progress=off"])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return os.path.join(args.work, "runs", name)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kiln", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--result")
    args = p.parse_args()
    threads = next((int(s.split("=", 1)[1]) for s in args.set if s.startswith("run.threads=")),
                   torch.get_num_threads())
    args.work = tempfile.mkdtemp(prefix="kiln-bench-plan-")
    catalog = os.path.join(args.work, "this-cpu.toml")
    peak = measured_peak_flops(threads)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    write_catalog(catalog, peak, memory)
    args.set = args.set + [f"plan.catalog={catalog}"]

    repeats = []
    for k in range(args.repeats):
        name = f"r{k}"
        run = kiln(args, "pilot", [], name)
        kiln(args, "baseline", [], name)  # same run directory: beside the pilot
        # One GPU: the machine the pilot ran on, one process (at the default 8 the plan adds a
        # DDP all-reduce over this row's 1 GB/s "network", which the baseline never pays).
        kiln(args, "plan", ["--pilot", run] + sets(["plan.hardware=this-cpu", "plan.gpus=1"]), name)
        pilot = json.load(open(os.path.join(run, "pilot.json")))
        baseline = json.load(open(os.path.join(run, "baseline.json")))
        plan = json.load(open(os.path.join(run, "plan.json")))
        row = next(r for r in plan["rows"] if r["hardware"] == "this-cpu")
        measured = baseline["step_seconds"]["median"]
        repeats.append({
            "pilot_step_seconds": pilot["step_seconds"],
            "pilot_mfu": pilot["mfu"],
            "plan_step_seconds": row["step_seconds"],
            "plan_mfu_source": row["mfu_source"],
            "baseline_step_seconds_median": measured,
            "baseline_step_seconds_p10": baseline["step_seconds"]["p10"],
            "baseline_step_seconds_p90": baseline["step_seconds"]["p90"],
            "ratio_plan_over_baseline": row["step_seconds"] / measured,
        })
        print(f"repeat {k + 1}: plan {1e3 * row['step_seconds']:.2f} ms, baseline median "
              f"{1e3 * measured:.2f} ms, ratio {row['step_seconds'] / measured:.3f}", flush=True)

    result = {
        "benchmark": "plan's projected step time vs the baseline rung's measured step time",
        "config": args.config,
        "overrides": [s for s in args.set if not s.startswith("plan.catalog=")],
        "threads": threads,
        "measured_fp32_peak_flops_per_second": peak,
        "repeats": repeats,
        "ratio_plan_over_baseline_median": statistics.median(
            r["ratio_plan_over_baseline"] for r in repeats),
        "machine": platform.platform(),
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "method": __doc__.strip(),
    }
    print(json.dumps({k: result[k] for k in ("ratio_plan_over_baseline_median",
                                             "measured_fp32_peak_flops_per_second")}))
    if args.result:
        with open(args.result, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
