"""Python interop for the profile rung.

1. `kiln profile` writes <hostname>_<pid>.<ns>.pt.trace.json.gz files that Python's gzip and json
   modules read, whose traceEvents hold the ProfilerStep#N annotations, the phase scopes and
   aten operators, and a profile.json that json reads.
2. `kiln profile --analyze` reads a trace written by Python's torch.profiler (schedule,
   record_function phases, tensorboard_trace_handler with gzip) and prints its analysis.

usage: trace_interop.py <kiln binary> <source dir>
"""
import gzip
import json
import pathlib
import re
import socket
import subprocess
import sys
import tempfile


def check(condition, message):
    if not condition:
        print("FAIL:", message, file=sys.stderr)
        sys.exit(1)


def kiln_traces_read_in_python(kiln, source, work):
    command = [kiln, "profile", str(source / "configs" / "mlp.toml")]
    for override in ["run.dir=" + str(work), "run.name=p", "run.progress=off", "profile.skip_first=1",
                     "profile.wait=0", "profile.warmup=1", "profile.active=3", "data.num_workers=2",
                     "run.threads=1"]:
        command += ["--set", override]
    run = subprocess.run(command, capture_output=True, text=True)
    check(run.returncode == 0, f"kiln profile failed ({run.returncode}): {run.stderr}")
    check("Top operators" in run.stdout and "Verdict:" in run.stdout, "no tables printed:\n" + run.stdout)

    traces = sorted((work / "p" / "traces").glob("*"))
    check(len(traces) == 1, f"expected one trace file, found {traces}")
    name = traces[0].name
    pattern = re.escape(socket.gethostname()) + r"_[0-9]+\.[0-9]+\.pt\.trace\.json\.gz"
    check(re.fullmatch(pattern, name) is not None, f"{name} does not follow <hostname>_<pid>.<ns>.pt.trace.json.gz")
    with gzip.open(traces[0], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    names = [e.get("name", "") for e in events]
    for step in ("ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"):
        check(names.count(step) == 1, f"{step} appears {names.count(step)} times")
    check("ProfilerStep#1" not in names, "the warm-up step was recorded")
    for phase in ("data_wait", "forward", "backward", "optimizer"):
        scopes = [e for e in events if e.get("name") == phase]
        check(len(scopes) == 3, f"{phase}: {len(scopes)} scopes, expected 3")
        check(all(e.get("cat") == "user_annotation" for e in scopes), f"{phase} is not a user annotation")
    aten = [e for e in events if e.get("cat") == "cpu_op" and e.get("name", "").startswith("aten::")]
    check(len(aten) > 50, f"only {len(aten)} aten operators")
    check(any(e["name"] == "aten::addmm" and "Input Dims" in e.get("args", {}) for e in aten),
          "no aten::addmm with input shapes")
    report = json.loads((work / "p" / "profile.json").read_text())
    check(report["passed"] is True, "profile.json: gate not passed")
    check(report["verdict"]["bottleneck"] in ("data-bound", "host-bound", "compute-bound"), report["verdict"])


def torch_profiler_trace_analysed_by_kiln(kiln, work):
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = work / "torch-traces"
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                 on_trace_ready=tensorboard_trace_handler(str(out), use_gzip=True), record_shapes=True) as prof:
        for _ in range(5):
            with record_function("data_wait"):
                x, y = torch.randn(32, 100), torch.randint(0, 10, (32,))
            with record_function("forward"):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            prof.step()
    # A directory of traces, and the job's config after it for the thresholds and settings.
    run = subprocess.run([kiln, "profile", "--analyze", str(out), str(pathlib.Path(sys.argv[2]) / "configs" / "mlp.toml")],
                         capture_output=True, text=True)
    check(run.returncode == 0, f"kiln profile --analyze failed ({run.returncode}): {run.stderr}")
    check("3 steps, 1 window" in run.stdout, "unexpected step count:\n" + run.stdout)
    check("aten::addmm" in run.stdout and "forward" in run.stdout and "Verdict:" in run.stdout, run.stdout)


def main():
    kiln, source = sys.argv[1], pathlib.Path(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        kiln_traces_read_in_python(kiln, source, work)
        torch_profiler_trace_analysed_by_kiln(kiln, work)
    print("profile trace interop: ok")


if __name__ == "__main__":
    main()
