"""The graph runner's overhead: kiln's native C++ llama against the same llama exported from its
Python twin and trained as a package (model.name = "exported"), one run, alternated.

`kiln peer export` writes the native model's initial weights; the twin (python/kiln_py/models.py
from_config, the config's [model] table) is imported with them (`kiln model import --weights`), so
both sides train the same function from the same weights. Then `kiln baseline` runs each side
--repeats times, alternating, and the median step time of each baseline.json is kept per repeat.

    .venv/bin/python bench/exported/native.py --kiln build/kiln --repeats 5 \
        --result bench/results/exported-vs-native-llama-tiny.json
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


def baseline(kiln, config, run_dir, overrides):
    command = [kiln, "baseline", config, "--set", f"run.dir={run_dir}", "--set", "run.name=b",
               "--set", "run.progress=off"]
    for o in overrides:
        command += ["--set", o]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "b", "baseline.json")) as f:
        result = json.load(f)
    return result["step_seconds"]["median"], result["loss_end"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kiln", required=True)
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "llama-tiny.toml"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("a ratio needs --repeats 5 or more")
    common = [f"run.threads={args.threads}", "data.num_workers=0"]
    with tempfile.TemporaryDirectory(prefix="kiln-bench-native-") as scratch:
        peer = os.path.join(scratch, "peer")
        subprocess.run([args.kiln, "peer", "export", args.config, "--steps", "1", "--out", peer]
                       + [x for o in common for x in ("--set", o)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(peer, "config.toml"), "rb") as f:
            cfg = tomllib.load(f)
        seq = int(cfg["data"]["seq_len"])
        package = os.path.join(scratch, "package")
        began = time.perf_counter()
        subprocess.run([args.kiln, "model", "import", "--module",
                        os.path.join(REPO, "python", "kiln_py", "models.py") + ":from_config",
                        "--options", json.dumps({"m": cfg["model"]}), "--weights",
                        os.path.join(peer, "init.safetensors"), "--max-seq", str(seq), "--out",
                        package], check=True, stdout=subprocess.DEVNULL)
        import_seconds = time.perf_counter() - began
        exported = common + ["model.name=exported", f"model.package={package}"]
        native_s, exported_s, losses = [], [], []
        for r in range(args.repeats):
            n, n_loss = baseline(args.kiln, args.config, os.path.join(scratch, f"n{r}"), common)
            e, e_loss = baseline(args.kiln, args.config, os.path.join(scratch, f"e{r}"), exported)
            native_s.append(n)
            exported_s.append(e)
            losses.append({"native": n_loss, "exported": e_loss})
            print(f"repeat {r}: native {1e3 * n:.3f} ms, exported {1e3 * e:.3f} ms, "
                  f"exported/native {e / n:.3f}, loss_end {n_loss:.6f} / {e_loss:.6f}", flush=True)
    ratio = statistics.median(exported_s) / statistics.median(native_s)
    print(f"median step: native {1e3 * statistics.median(native_s):.3f} ms, exported "
          f"{1e3 * statistics.median(exported_s):.3f} ms, exported/native = {ratio:.3f}; import "
          f"{import_seconds:.1f} s")
    if args.result:
        with open(args.result, "w") as f:
            json.dump({"config": os.path.relpath(args.config, REPO), "threads": args.threads,
                       "repeats": args.repeats, "native_median_step_seconds_per_repeat": native_s,
                       "exported_median_step_seconds_per_repeat": exported_s,
                       "ratio_exported_over_native_per_repeat":
                           [e / n for e, n in zip(exported_s, native_s)],
                       "ratio_exported_over_native": ratio, "loss_end_per_repeat": losses,
                       "import_seconds": import_seconds,
                       "machine": platform.processor() or platform.machine(),
                       "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                      f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
