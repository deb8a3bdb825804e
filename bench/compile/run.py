#!/usr/bin/env python3
"""kiln's compiled step against Python's torch.compile, side by side, same run.

    .venv/bin/python bench/compile/run.py --kiln build/kiln --config configs/gpt-tiny.toml \
        --set run.threads=2 --result bench/results/compile-gpt-tiny.json

Four step times, same model, batch shape, optimizer and thread count:
  kiln eager and kiln inductor: `kiln compile` (the compile rung: AOTInductor forward+backward
      package loaded from C++, eager and compiled steps interleaved in one process), first with a
      cold package cache, then again with the cache warm;
  Python eager and Python torch.compile (inductor, default mode): the twin model from
      python/kiln_py, AdamW as kiln's, batches preloaded, eager and compiled steps interleaved.
Repeated --repeats times, alternating kiln and Python; the medians of the per-repeat medians and
their ratios are reported (lower is faster for the numerator), and every repeat's numbers are kept
in the result ("repeats_detail"). Compile times: kiln cold and cached (package build or load),
Python's first compiled iteration.

train.precision = "bf16-mixed" (--set train.precision=bf16-mixed): kiln's package is exported
under autocast; the Python side runs its forward and loss under torch.autocast(cpu, bfloat16),
eager and torch.compile alike, with fp32 parameters and optimizer, as kiln does.
"""
import contextlib
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
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench", "peer"))

import torch  # noqa: E402

from kiln_py.models import from_config, loss as model_loss  # noqa: E402
from peer import make_optimizer  # noqa: E402


def cpu_flags():
    """The instruction-set extensions that decide bf16 speed (native bf16 or emulated)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if x in flags]


def bench_parser(doc, warmup, steps):
    """The options every compile bench takes (its own added by the caller)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--kiln", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps first (compile, load)")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per side per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="at least 5: the ratios are medians over them")
    parser.add_argument("--result", help="write the comparison as JSON here")
    return parser


def parse_bench_args(parser):
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("a ratio needs --repeats 5 or more")
    return args


def write_result(path, result):
    """The comparison as JSON, when --result names a file (every repeat's numbers inside)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


def sets(overrides):
    out = []
    for o in overrides:
        out += ["--set", o]
    return out


def resolved_config(kiln, config, overrides, work):
    out = os.path.join(work, "export")
    subprocess.run([kiln, "peer", "export", config, "--steps", "1", "--out", out] +
                   sets(overrides + [f"run.dir={work}/runs", "run.name=export"]),
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "config.toml"), "rb") as f:
        return tomllib.load(f)


def kiln_side(kiln, config, overrides, work, name, cache, warmup, steps):
    run = [kiln, "compile", config] + sets(overrides + [
        f"run.dir={work}/runs", f"run.name={name}", "run.progress=off",
        "compile.backend=inductor", "compile.probe_seq_lens=none", f"compile.cache_dir={cache}",
        f"compile.warmup_steps={warmup}", f"compile.steps={steps}"])
    subprocess.run(run, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(work, "runs", name, "compile.json")) as f:
        return json.load(f)


TOKEN_MODELS = ("gpt", "llama")  # [B, T] token ids in; the rest take [B, input_dim] features


def python_side(cfg, warmup, steps):
    torch.manual_seed(cfg["run"]["seed"])
    threads = cfg["run"]["threads"]
    if threads > 0:
        torch.set_num_threads(threads)
    if cfg["run"]["deterministic"]:
        # As kiln: its eager step runs under deterministic algorithms (warn only; empty tensors
        # are then filled, as kiln's are) and its package was compiled so (compile.py).
        torch.use_deterministic_algorithms(True, warn_only=True)
        import torch._inductor.config as inductor_config
        inductor_config.deterministic = True
    batch = cfg["train"]["batch_size"]
    m = cfg["model"]
    if m["name"] in TOKEN_MODELS:
        twin = from_config(m)
        embedding = twin.transformer.wte if m["name"] == "gpt" else twin.model.embed_tokens
        vocab = embedding.num_embeddings
        inputs = torch.randint(0, vocab, (batch, cfg["data"]["seq_len"]))
        targets = torch.randint(0, vocab, (batch, cfg["data"]["seq_len"]))
    else:
        inputs = torch.randn(batch, m["input_dim"])
        targets = torch.randint(0, m["num_classes"], (batch,))
    clip = cfg["train"]["clip_grad_norm"]
    precision = cfg["train"].get("precision", "fp32")
    if precision not in ("fp32", "bf16-mixed"):
        raise SystemExit(f"train.precision = {precision!r}: this bench compares fp32 and "
                         f"bf16-mixed (fp16-mixed needs Python's GradScaler)")

    def autocast():
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def side(compiled):
        model = from_config(m)
        model.train()
        fn = torch.compile(model) if compiled else model
        optimizer = make_optimizer(model, cfg["optim"])
        params = list(model.parameters())

        def step():
            begin = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = model_loss(fn(inputs), targets)
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            loss.item()
            return time.perf_counter() - begin
        return step

    eager, compiled = side(False), side(True)
    first_compiled = compiled()  # torch.compile's first iteration: tracing and Inductor
    for _ in range(warmup):
        eager()
        compiled()
    eager_s, compiled_s = [], []
    for _ in range(steps):
        eager_s.append(eager())
        compiled_s.append(compiled())
    return statistics.median(eager_s), statistics.median(compiled_s), first_compiled


def main():
    args = parse_bench_args(bench_parser(__doc__, warmup=3, steps=15))

    with tempfile.TemporaryDirectory(prefix="kiln-compile-bench-") as work:
        cfg = resolved_config(args.kiln, args.config, args.overrides, work)
        if cfg["train"]["grad_accum_steps"] != 1:
            raise SystemExit("train.grad_accum_steps must be 1 here (--set "
                             "train.grad_accum_steps=1): this bench's Python side runs one "
                             "batch per optimizer step")
        cache = os.path.join(work, "cache")  # cold for the first kiln run, warm afterwards
        kiln_runs, py_runs, loads = [], [], []
        for r in range(args.repeats):
            loads.append({"before_kiln": os.getloadavg()[0]})  # 1-minute load average (uptime's)
            kiln_runs.append(kiln_side(args.kiln, args.config, args.overrides, work, f"k{r}", cache,
                                       args.warmup, args.steps))
            loads[-1]["before_python"] = os.getloadavg()[0]
            py_runs.append(python_side(cfg, args.warmup, args.steps))
            loads[-1]["after_python"] = os.getloadavg()[0]
            k = kiln_runs[-1]
            print(f"repeat {r + 1}: kiln eager {1e3 * k['eager']['median_seconds']:.2f} ms, "
                  f"kiln inductor {1e3 * k['compiled']['median_seconds']:.2f} ms "
                  f"(compile {k['compile_seconds']:.1f} s, {k['cache']}); python eager "
                  f"{1e3 * py_runs[-1][0]:.2f} ms, torch.compile {1e3 * py_runs[-1][1]:.2f} ms "
                  f"(first iteration {py_runs[-1][2]:.1f} s); load {loads[-1]}", flush=True)

    med = statistics.median
    kiln_eager = med(k["eager"]["median_seconds"] for k in kiln_runs)
    kiln_compiled = med(k["compiled"]["median_seconds"] for k in kiln_runs)
    py_eager = med(p[0] for p in py_runs)
    py_compiled = med(p[1] for p in py_runs)
    result = {
        "config": args.config, "overrides": args.overrides, "model": cfg["model"],
        "batch_size": cfg["train"]["batch_size"],
        "seq_len": cfg["data"]["seq_len"] if cfg["model"]["name"] in TOKEN_MODELS else None,
        "deterministic": cfg["run"]["deterministic"],
        "threads": torch.get_num_threads(), "repeats": args.repeats, "warmup": args.warmup,
        "timed_steps": args.steps,
        "median_step_seconds": {"kiln_eager": kiln_eager, "kiln_inductor": kiln_compiled,
                                "python_eager": py_eager, "python_torch_compile": py_compiled},
        "ratios": {"kiln_inductor_over_python_torch_compile": kiln_compiled / py_compiled,
                   "kiln_inductor_over_kiln_eager": kiln_compiled / kiln_eager,
                   "kiln_eager_over_python_eager": kiln_eager / py_eager,
                   "python_torch_compile_over_python_eager": py_compiled / py_eager},
        # Each repeat's own ratio (kiln and Python timed minutes apart, so under the same load),
        # and their median: steadier than the ratio of medians on a shared, loaded machine.
        "median_of_repeat_ratios": {
            "kiln_inductor_over_python_torch_compile": statistics.median(
                k["compiled"]["median_seconds"] / p[1] for k, p in zip(kiln_runs, py_runs)),
            "kiln_inductor_over_kiln_eager": statistics.median(
                k["compiled"]["median_seconds"] / k["eager"]["median_seconds"] for k in kiln_runs)},
        "compile_seconds": {"kiln_cold": kiln_runs[0]["compile_seconds"],
                            "kiln_cached": [k["compile_seconds"] for k in kiln_runs[1:]],
                            "python_first_iteration": [p[2] for p in py_runs]},
        "precision": cfg["train"].get("precision", "fp32"),
        "kiln_numerics": [k["numerics"]["max_relative_loss_difference"] for k in kiln_runs],
        "repeats_detail": [
            {"kiln_eager": k["eager"]["median_seconds"],
             "kiln_inductor": k["compiled"]["median_seconds"],
             "kiln_compile_seconds": k["compile_seconds"], "kiln_cache": k["cache"],
             "python_eager": p[0], "python_torch_compile": p[1],
             "python_first_iteration_seconds": p[2],
             "ratio_kiln_inductor_over_python_torch_compile": k["compiled"]["median_seconds"] / p[1],
             "ratio_kiln_inductor_over_kiln_eager": k["compiled"]["median_seconds"]
             / k["eager"]["median_seconds"],
             "load_average_1min": l}
            for k, p, l in zip(kiln_runs, py_runs, loads)],
        "kiln_verdicts": [k["verdict"] for k in kiln_runs],
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "cpu_flags": cpu_flags(),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    # The model's math per step (kiln's Model::train_flops_per_sample, the same for every side)
    # at each side's median, against this machine's matmul as kiln's compile rung timed it in
    # each repeat (the job's largest GEMM in its precision): the share of peak, every side.
    if all(k.get("flops_per_sample") and k.get("matmul_peak") for k in kiln_runs):
        flops_per_step = kiln_runs[0]["flops_per_sample"] * cfg["train"]["batch_size"]
        peaks = [k["matmul_peak"]["flops_per_second"] for k in kiln_runs]
        per_repeat = {
            "kiln_eager": [k["eager"]["median_seconds"] for k in kiln_runs],
            "kiln_inductor": [k["compiled"]["median_seconds"] for k in kiln_runs],
            "python_eager": [p[0] for p in py_runs],
            "python_torch_compile": [p[1] for p in py_runs]}
        result["flops_per_step"] = flops_per_step
        result["matmul_peak"] = {"flops_per_second_per_repeat": peaks,
                                 "median_flops_per_second": med(peaks),
                                 "shape": {d: kiln_runs[0]["matmul_peak"][d] for d in "mnk"},
                                 "dtype": kiln_runs[0]["matmul_peak"]["dtype"]}
        result["share_of_matmul_peak"] = {
            side: med(flops_per_step / s / p for s, p in zip(seconds, peaks))
            for side, seconds in per_repeat.items()}
        result["achieved_flops_per_second"] = {
            side: flops_per_step / med(seconds) for side, seconds in per_repeat.items()}
        for side, share in result["share_of_matmul_peak"].items():
            print(f"{side}: {result['achieved_flops_per_second'][side]:.3g} FLOP/s, "
                  f"{100 * share:.1f}% of the measured matmul")
    for key, value in result["ratios"].items():
        print(f"{key}: {value:.3f}")
    write_result(args.result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
