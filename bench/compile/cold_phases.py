#!/usr/bin/env python3
"""Where a cold compile's seconds go, kiln beside Python's torch.compile, same run.

    .venv/bin/python bench/compile/cold_phases.py --kiln build/kiln --config configs/gpt-tiny.toml \
        --set run.threads=2 --repeats 5 --result bench/results/compile-cold-phases-gpt-tiny.json

Each repeat starts both sides cold: a new kiln package cache (compile.cache_dir) and a new
Inductor cache (TORCHINDUCTOR_CACHE_DIR) for each, nothing shared with an earlier repeat.

  kiln: `kiln compile` (compile.backend = inductor, the config's compile.granularity); its
      compile.json gives the whole compile as kiln waits for it (`compile_seconds`: every package
      built, loaded and bound) and each package's record in the cache
      (`<cache>/<key>.json`, "report": the compiler's result) gives that package's phases:
      the compiler's `import torch`, torch._dynamo.explain, torch.export, the joint graph, the
      AOTInductor build, and the package load that reads its constants, with the AOTInductor build
      broken down by torch's own timers (`inductor_seconds`: torch._dynamo.utils.
      compilation_time_metrics, nested regions inside their parents).
  Python: a fresh process: `import torch`, the twin model from python/kiln_py with AdamW, and
      torch.compile's first iteration (forward, loss, backward, clip, optimizer step), with the
      same torch timers read after it. Under train.activation_checkpointing = "block" (kiln's unit
      mode) each block is wrapped in checkpoint_wrapper and compiled on its own instead of the
      whole model.

With --first-step the bench times instead what a user waits for: process start to the first
compiled training step, cold and warm, as `kiln train` runs it (compile.backend = inductor,
train.steps = 1, no evaluation; timed to its "step 1/1" log line) beside the Python child (timed
to its result line, printed right after its first iteration). Each repeat runs, in order: kiln
cold (new package and Inductor caches), kiln cold under the control's environment (--control
NAME=VALUE, repeatable; by default the ISA-check child off, KILN_COMPILE_ISA_PROBE=0; its own new
caches), Python cold (a new Inductor cache),
then kiln warm (the first cold run's caches: every package cached) and Python warm (its cold run's
Inductor cache: FX-graph and AOTAutograd caches warm, as torch.compile's second start).

Reported per repeat and as medians over the repeats: kiln's compile and its phases summed over
its packages (and the largest phases of torch's timers on both sides), Python's import and first
iteration, and the ratio kiln compile / Python first iteration (lower is faster for kiln).
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
# bench/compile/run.py's helpers import torch: imported by the parent only (main), so the Python
# child's `import torch` is timed cold.

# The compiler's own phases (compile.py's "seconds"), in the order they run.
KILN_PHASES = ["import_torch", "explain", "export", "joint", "trace", "compile_forward",
               "compile_backward", "compile", "check", "constants"]


def python_child(config_json):
    """Runs in a fresh process: prints one JSON line with the import, the first compiled
    iteration and torch's phase timers."""
    began = time.perf_counter()
    import torch
    import_seconds = time.perf_counter() - began
    sys.path.insert(0, os.path.join(ROOT, "python"))
    sys.path.insert(0, os.path.join(ROOT, "bench", "peer"))
    from kiln_py.models import from_config, loss as model_loss
    from peer import make_optimizer

    cfg = json.loads(config_json)
    torch.manual_seed(cfg["run"]["seed"])
    if cfg["run"]["threads"] > 0:
        torch.set_num_threads(cfg["run"]["threads"])
    if cfg["run"]["deterministic"]:
        torch.use_deterministic_algorithms(True, warn_only=True)
        import torch._inductor.config as inductor_config
        inductor_config.deterministic = True
    m = cfg["model"]
    batch, seq = cfg["train"]["batch_size"], cfg["data"]["seq_len"]
    model = from_config(m)
    model.train()
    vocab = model.transformer.wte.num_embeddings if m["name"] == "gpt" \
        else model.model.embed_tokens.num_embeddings
    inputs = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    optimizer = make_optimizer(model, cfg["optim"])
    if cfg["train"].get("activation_checkpointing", "none") == "block":
        # kiln's unit mode under block checkpointing: each block checkpointed and compiled on its
        # own (torchtitan's way), the rest eager.
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        blocks = model.transformer.h if m["name"] == "gpt" else model.model.layers
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
            blocks[i].compile()
        compiled = model
    else:
        compiled = torch.compile(model)
    precision = cfg["train"].get("precision", "fp32")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    begin = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    with autocast:
        loss = model_loss(compiled(inputs), targets)
    loss.backward()
    if cfg["train"]["clip_grad_norm"] > 0:
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg["train"]["clip_grad_norm"])
    optimizer.step()
    loss.item()
    first = time.perf_counter() - begin
    from torch._dynamo.utils import compilation_time_metrics
    timers = {k: round(sum(v), 4) for k, v in compilation_time_metrics.items() if sum(v) >= 1e-3}
    print(json.dumps({"import_torch_seconds": import_seconds, "first_iteration_seconds": first,
                      "torch_timers": timers}))


def kiln_side(kiln, config, overrides, work, name, env):
    from run import sets
    cache = os.path.join(work, f"{name}-packages")
    run = [kiln, "compile", config] + sets(overrides + [
        f"run.dir={work}/runs", f"run.name={name}", "run.progress=off",
        "compile.backend=inductor", "compile.probe_seq_lens=none", f"compile.cache_dir={cache}",
        "compile.warmup_steps=1", "compile.steps=2"])
    began = time.perf_counter()
    subprocess.run(run, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - began
    with open(os.path.join(work, "runs", name, "compile.json")) as f:
        report = json.load(f)
    phases, timers, packages = {}, {}, 0
    for root, _, files in os.walk(cache):
        for file in files:
            if not file.endswith(".json"):
                continue
            with open(os.path.join(root, file)) as f:
                record = json.load(f)
            if "report" not in record:
                continue
            packages += 1
            for k, v in record["report"].get("seconds", {}).items():
                phases[k] = phases.get(k, 0.0) + v
            for k, v in record["report"].get("inductor_seconds", {}).items():
                timers[k] = timers.get(k, 0.0) + v
    return {"compile_seconds": report["compile_seconds"], "wall_seconds": wall,
            "packages": packages, "phases_summed_over_packages": phases,
            "torch_timers_summed_over_packages": timers}


def time_to_line(cmd, env, marker):
    """Runs cmd; returns (seconds from start to the first output line containing marker,
    seconds to exit). Raises when it fails or never prints the marker."""
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    seen, tail = None, []
    for line in proc.stdout:
        if seen is None and marker in line:
            seen = time.perf_counter() - began
        tail = (tail + [line])[-20:]
    code = proc.wait()
    ended = time.perf_counter() - began
    if code != 0 or seen is None:
        raise SystemExit(f"{' '.join(cmd[:3])} ... exit {code}, marker {marker!r} "
                         f"{'seen' if seen else 'not seen'}:\n{''.join(tail)}")
    return seen, ended


def first_step_repeat(args, cfg, work, r):
    from run import sets

    def kiln(name, cache, inductor, extra_env=None):
        cmd = [args.kiln, "train", args.config] + sets(args.overrides + [
            f"run.dir={work}/runs", f"run.name={name}", "run.progress=log",
            "compile.backend=inductor", f"compile.cache_dir={cache}", "train.steps=1",
            "train.eval_every=0"])
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, **(extra_env or {}))
        first, whole = time_to_line(cmd, env, "step 1/1 ")
        return {"first_step_seconds": first, "process_seconds": whole}

    def python(inductor):
        cmd = [sys.executable, __file__, "--kiln", args.kiln, "--config", args.config,
               "--python-child", json.dumps(cfg)]
        first, whole = time_to_line(cmd, dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor),
                                    "first_iteration_seconds")
        return {"first_step_seconds": first, "process_seconds": whole}

    cache, inductor = os.path.join(work, f"k{r}-packages"), os.path.join(work, f"inductor-k{r}")
    row = {"load_before": os.getloadavg()[0]}
    row["kiln_cold"] = kiln(f"k{r}", cache, inductor)
    row["kiln_cold_control"] = kiln(f"n{r}", os.path.join(work, f"n{r}-packages"),
                                    os.path.join(work, f"inductor-n{r}"), control_env(args))
    python_inductor = os.path.join(work, f"inductor-p{r}")
    row["python_cold"] = python(python_inductor)
    row["kiln_warm"] = kiln(f"w{r}", cache, inductor)
    row["python_warm"] = python(python_inductor)
    for name in ("cold", "warm"):
        row[f"ratio_{name}"] = (row[f"kiln_{name}"]["first_step_seconds"] /
                                row[f"python_{name}"]["first_step_seconds"])
    row["ratio_cold_control"] = (row["kiln_cold_control"]["first_step_seconds"] /
                                      row["python_cold"]["first_step_seconds"])
    print(f"repeat {r + 1}: first compiled step, cold: kiln {row['kiln_cold']['first_step_seconds']:.1f} s"
          f" (control {row['kiln_cold_control']['first_step_seconds']:.1f} s), python "
          f"{row['python_cold']['first_step_seconds']:.1f} s, ratio {row['ratio_cold']:.2f} | warm: "
          f"kiln {row['kiln_warm']['first_step_seconds']:.2f} s, python "
          f"{row['python_warm']['first_step_seconds']:.2f} s", flush=True)
    return row


def first_step_result(args, repeats, machine):
    columns = ["kiln_cold", "kiln_cold_control", "python_cold", "kiln_warm", "python_warm"]
    median = {f"{c}_first_step_seconds": statistics.median(r[c]["first_step_seconds"]
                                                           for r in repeats) for c in columns}
    median.update({f"{c}_process_seconds": statistics.median(r[c]["process_seconds"]
                                                             for r in repeats) for c in columns})
    for ratio in ("ratio_cold", "ratio_cold_control", "ratio_warm"):
        median[ratio] = statistics.median(r[ratio] for r in repeats)
    return {"benchmark": "process start to the first compiled training step, cold and warm: "
                         "kiln train beside Python torch.compile",
            "config": args.config, "overrides": args.overrides, "repeats": args.repeats,
            "control_env": control_env(args), "machine": machine, "median": median,
            "repeats_detail": repeats}


def control_env(args):
    """The control run's environment: --control NAME=VALUE, each, or the ISA child off."""
    pairs = args.control or ["KILN_COMPILE_ISA_PROBE=0"]
    return dict(p.split("=", 1) for p in pairs)


def top(timers, n=8):
    return dict(sorted(timers.items(), key=lambda kv: -kv[1])[:n])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kiln", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--result")
    parser.add_argument("--first-step", action="store_true",
                        help="time process start to the first compiled step, cold and warm")
    parser.add_argument("--control", action="append", metavar="NAME=VALUE",
                        help="with --first-step: the cold control run's environment (repeat for "
                             "more; default KILN_COMPILE_ISA_PROBE=0, the ISA child off)")
    parser.add_argument("--python-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.control and any("=" not in c for c in args.control):
        parser.error("--control takes NAME=VALUE")
    if args.python_child:
        python_child(args.python_child)
        return
    if args.repeats < 5:
        parser.error("a ratio needs --repeats 5 or more")
    from run import cpu_flags, resolved_config, write_result
    with tempfile.TemporaryDirectory(prefix="kiln-cold-phases-") as work:
        cfg = resolved_config(args.kiln, args.config, args.overrides, work)
        if cfg["model"]["name"] not in ("gpt", "llama"):
            raise SystemExit("this bench compiles token models (gpt, llama)")
        repeats = []
        machine = {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags(),
                   "cores": os.cpu_count()}
        if args.first_step:
            repeats = [first_step_repeat(args, cfg, work, r) for r in range(args.repeats)]
            result = first_step_result(args, repeats, machine)
            print(json.dumps(result["median"], indent=2))
            write_result(args.result, result)
            return
        for r in range(args.repeats):
            row = {"load_before": os.getloadavg()[0]}
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(work, f"inductor-k{r}"))
            row["kiln"] = kiln_side(args.kiln, args.config, args.overrides, work, f"k{r}", env)
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(work, f"inductor-p{r}"))
            out = subprocess.run([sys.executable, __file__, "--kiln", args.kiln, "--config",
                                  args.config, "--python-child", json.dumps(cfg)],
                                 check=True, capture_output=True, text=True, env=env)
            row["python"] = json.loads(out.stdout.strip().splitlines()[-1])
            row["ratio_kiln_compile_over_python_first_iteration"] = (
                row["kiln"]["compile_seconds"] / row["python"]["first_iteration_seconds"])
            k, p = row["kiln"], row["python"]
            print(f"repeat {r + 1}: kiln compile {k['compile_seconds']:.1f} s ({k['packages']} "
                  f"packages; " + ", ".join(f"{name} {k['phases_summed_over_packages'][name]:.1f}"
                                             for name in KILN_PHASES
                                             if name in k["phases_summed_over_packages"]) +
                  f"; C++ compile {k['torch_timers_summed_over_packages'].get('compile_file', 0):.1f}"
                  f") | python import {p['import_torch_seconds']:.1f} s, first iteration "
                  f"{p['first_iteration_seconds']:.1f} s (C++ compile "
                  f"{p['torch_timers'].get('compile_file', 0):.1f}) | ratio "
                  f"{row['ratio_kiln_compile_over_python_first_iteration']:.2f}", flush=True)
            repeats.append(row)

    def med(values):
        return statistics.median(list(values))

    phases = sorted({name for row in repeats for name in row["kiln"]["phases_summed_over_packages"]},
                    key=lambda n: KILN_PHASES.index(n) if n in KILN_PHASES else len(KILN_PHASES))
    kiln_timers = {name for row in repeats for name in row["kiln"]["torch_timers_summed_over_packages"]}
    python_timers = {name for row in repeats for name in row["python"]["torch_timers"]}
    result = {
        "benchmark": "cold compile: kiln's phases beside Python torch.compile's first iteration",
        "config": args.config, "overrides": args.overrides, "repeats": args.repeats,
        "machine": machine,
        "median": {
            "kiln_compile_seconds": med(r["kiln"]["compile_seconds"] for r in repeats),
            "kiln_phases_summed_over_packages": {
                n: med(r["kiln"]["phases_summed_over_packages"].get(n, 0.0) for r in repeats)
                for n in phases},
            "kiln_torch_timers": top({n: med(r["kiln"]["torch_timers_summed_over_packages"].get(n, 0.0)
                                             for r in repeats) for n in kiln_timers}, 12),
            "python_import_torch_seconds": med(r["python"]["import_torch_seconds"] for r in repeats),
            "python_first_iteration_seconds": med(r["python"]["first_iteration_seconds"]
                                                  for r in repeats),
            "python_torch_timers": top({n: med(r["python"]["torch_timers"].get(n, 0.0)
                                               for r in repeats) for n in python_timers}, 12),
            "ratio_kiln_compile_over_python_first_iteration": med(
                r["ratio_kiln_compile_over_python_first_iteration"] for r in repeats),
        },
        "repeats_detail": repeats,
    }
    print(json.dumps(result["median"], indent=2))
    write_result(args.result, result)


if __name__ == "__main__":
    main()
