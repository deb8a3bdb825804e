#!/usr/bin/env python3
"""Forecast against actual: the plan model's forecast, calibrated by a pilot, against separate
runs of the same job on the same machine.

    .venv/bin/python bench/plan/run.py --kiln build/kiln --config configs/gpt-tiny.toml \
        --set run.threads=2 --repeats 5 --result bench/results/plan-gpt-tiny.json

Per repeat:
1. `kiln pilot CONFIG` (the production shape; its step time is the median of its timed steps,
   pilot.json's step_timing; its timed matmul at the job's shape: pilot.json's matmul_peak; the
   blocking part of an async save: checkpoint.save_blocking_seconds, and the wait that finished
   it after an evaluation: checkpoint.save_end_wait_seconds).
2. `kiln train CONFIG` for --steps steps with plan.pilot = that pilot (it logs the forecast at
   its start and tracks itself against it: metrics.jsonl's plan records), saving every
   --save-every steps, then `kiln plan CONFIG --actual TRAIN_RUN`: the forecast step time
   against the median of metrics.jsonl's steps (the first tenth left out), the forecast wall
   time and ETTR against the final plan record's; and the checkpoint time: the forecast's time
   lost to checkpoints (each save's stall: with checkpoint.async the pilot's blocking part and
   end wait) against the final plan record's
   checkpoint_seconds (time in the checkpoint phase).
3. `kiln baseline CONFIG` with baseline.steps = --steps, then `kiln plan CONFIG --actual
   BASELINE_RUN`: the forecast step against the baseline's median.
4. A second `kiln pilot CONFIG` (another process), then `kiln plan CONFIG --pilot FIRST --actual
   SECOND`: the forecast peak memory against the second pilot's metered peak (tensor bytes, what
   the forecast counts; kiln train records no peak and a CPU baseline's is the process RSS).
Every command gets the same --set list (one job hash). The result keeps every repeat (with the
load average after it) and the median of forecast / actual for each quantity;
|forecast - actual| / actual is |ratio - 1|.
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


def sets(overrides):
    out = []
    for o in overrides:
        out += ["--set", o]
    return out


def kiln(args, command, extra, name):
    cmd = [args.kiln, command, args.config] + extra + sets(args.set + [
        f"run.dir={args.work}/runs", f"run.name={name}", "run.progress=off"])
    env = None
    if args.nproc > 1 and command in ("pilot", "train"):  # the mesh's ranks, one thread each
        cmd = [args.torchrun, "--standalone", "--no-python", f"--nproc-per-node={args.nproc}"] + cmd
        env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return os.path.join(args.work, "runs", name), done


def ratios(comparison):
    return {r["quantity"]: r["ratio"] for r in comparison["rows"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kiln", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--result")
    p.add_argument("--nproc", type=int, default=1,
                   help="run the pilots and the train under torchrun with this many ranks (the "
                        "mesh from --set dist.*; the baseline, one process only, is left out)")
    p.add_argument("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    args = p.parse_args()
    args.work = tempfile.mkdtemp(prefix="kiln-bench-plan-")
    args.set = args.set + [f"train.steps={args.steps}", f"baseline.steps={args.steps}",
                           "train.eval_every=0", f"checkpoint.every_steps={args.save_every}"]
    # The forecast's saves (src/plan/forecast.cpp): every --save-every steps, and the final one
    # (checkpoint.save_final) when the last step is not a multiple.
    saves = args.steps // args.save_every + (1 if args.steps % args.save_every else 0)

    repeats = []
    for k in range(args.repeats):
        pilot, _ = kiln(args, "pilot", [], f"p{k}")
        train, done = kiln(args, "train", sets([f"plan.pilot={pilot}"]), f"t{k}")
        forecast_line = next((line for line in (done.stdout + done.stderr).splitlines()
                              if "forecast (" in line), None)
        kiln(args, "plan", ["--pilot", pilot, "--actual", train], f"p{k}")
        base = None
        if args.nproc == 1:
            base, _ = kiln(args, "baseline", [], f"b{k}")
            kiln(args, "plan", ["--pilot", pilot, "--actual", base], f"p{k}")
        second, _ = kiln(args, "pilot", [], f"q{k}")
        kiln(args, "plan", ["--pilot", pilot, "--actual", second], f"p{k}")
        on_train = json.load(open(os.path.join(train, "plan-vs-actual.json")))
        on_base = json.load(open(os.path.join(base, "plan-vs-actual.json"))) if base else None
        on_second = json.load(open(os.path.join(second, "plan-vs-actual.json")))
        pilot_json = json.load(open(os.path.join(pilot, "pilot.json")))
        final = [json.loads(line)["plan"] for line in open(os.path.join(train, "metrics.jsonl"))
                 if '"plan"' in line][-1]
        row = {
            "matmul_peak_flops_per_second": pilot_json["matmul_peak"]["flops_per_second"],
            "pilot_mfu_of_matmul_peak": pilot_json["mfu_of_matmul_peak"],
            "pilot_step_seconds": pilot_json["step_seconds"],
            "pilot_step_timing": pilot_json.get("step_timing"),
            "pilot_save_seconds": pilot_json["checkpoint"]["save_seconds"],
            "pilot_save_blocking_seconds": pilot_json["checkpoint"].get("save_blocking_seconds"),
            "pilot_save_end_wait_seconds": pilot_json["checkpoint"].get("save_end_wait_seconds"),
            "train_forecast_logged": forecast_line,
            "train": on_train,
            "baseline": on_base,
            "second_pilot": on_second,
            "ratio_step_train": ratios(on_train)["step time"],
            "ratio_step_baseline": ratios(on_base)["step time"] if on_base else None,
            "ratio_peak_memory_second_pilot": ratios(on_second)["peak memory"],
            "ratio_save_second_pilot": ratios(on_second)["checkpoint save"],
            "train_final_plan_record": final,
            "train_saves": saves,
            "ratio_checkpoint_time_train": ratios(on_train)["time lost to checkpoints"],
            "ratio_wall_train": ratios(on_train)["wall time"],
            "ratio_ettr_train": ratios(on_train)["ETTR"],
            "load_average": os.getloadavg(),
        }
        repeats.append(row)
        baseline_text = (f"{row['ratio_step_baseline']:.3f} (baseline)" if on_base
                         else "no baseline (torchrun)")
        print(f"repeat {k + 1}: step forecast/actual {row['ratio_step_train']:.3f} (train), "
              f"{baseline_text}; peak memory "
              f"{row['ratio_peak_memory_second_pilot']:.3f}, save "
              f"{row['ratio_save_second_pilot']:.3f} (second pilot); checkpoint time "
              f"{row['ratio_checkpoint_time_train']:.3f}, wall {row['ratio_wall_train']:.3f}, "
              f"ETTR {row['ratio_ettr_train']:.3f} (train); load {row['load_average'][0]:.1f}; "
              f"most wrong on train: "
              f"{on_train['most_wrong']['text']}", flush=True)

    def median(key):
        values = [r[key] for r in repeats if r[key] is not None]
        return statistics.median(values) if values else None

    result = {
        "benchmark": "plan forecast (calibrated by a pilot) vs separate runs of the same job",
        "config": args.config,
        "overrides": args.set,
        "ranks": args.nproc,
        "steps": args.steps,
        "repeats": repeats,
        "median_ratio_step_forecast_over_train": median("ratio_step_train"),
        "median_ratio_step_forecast_over_baseline": median("ratio_step_baseline"),
        "median_ratio_peak_memory_forecast_over_second_pilot":
            median("ratio_peak_memory_second_pilot"),
        "median_ratio_save_forecast_over_second_pilot": median("ratio_save_second_pilot"),
        "median_ratio_checkpoint_time_forecast_over_train": median("ratio_checkpoint_time_train"),
        "median_ratio_wall_forecast_over_train": median("ratio_wall_train"),
        "median_ratio_ettr_forecast_over_train": median("ratio_ettr_train"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "method": __doc__.strip(),
    }
    print(json.dumps({k: v for k, v in result.items() if k.startswith("median_")}))
    if args.result:
        with open(args.result, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
