"""Profiler cost while the schedule waits, kiln beside Python's torch.profiler, in one run.

kiln: bench/profile/overhead.cpp (kiln_bench_profile_overhead) trains the seed MLP and a tiny GPT
with and without a Profiler hook whose schedule waits for the whole run.
Python: the same MLP step in PyTorch (AdamW fused, one intra-op thread), with and without
torch.profiler.profile(schedule=schedule(wait=10**9, warmup=0, active=1)) calling prof.step().
Both alternate blocks of steps and compare medians of the per-block mean step time; kiln also
times the hook's calls for one waiting step on their own (hook_ns_per_waiting_step).

usage: overhead.py <build dir> [output json]   (default bench/results/profile-overhead.json)
"""
import json
import pathlib
import platform
import statistics
import subprocess
import sys
import time

RUNS = 5  # processes per model: which trainer carries the hook rotates with the pid


def python_ratio(blocks=40, steps=50):
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.set_num_threads(1)
    torch.manual_seed(0)

    def make():
        model = torch.nn.Sequential(torch.nn.Linear(100, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    data = [(torch.randn(32, 100), torch.randint(0, 10, (32,))) for _ in range(64)]

    def step(model, optimizer, k):
        x, y = data[k % len(data)]
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    plain, profiled = make(), make()
    prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=10**9, warmup=0, active=1))
    prof.start()

    def block(pair, with_profiler):
        begin = time.perf_counter()
        for k in range(steps):
            step(*pair, k)
            if with_profiler:
                prof.step()
        return (time.perf_counter() - begin) / steps

    block(plain, False), block(profiled, True)
    plain_s, profiled_s = [], []
    for b in range(blocks):
        order = [(plain, False), (profiled, True)] if b % 2 == 0 else [(profiled, True), (plain, False)]
        for pair, with_profiler in order:
            (profiled_s if with_profiler else plain_s).append(block(pair, with_profiler))
    prof.stop()
    paired = statistics.median(p / q for p, q in zip(profiled_s, plain_s))
    return {
        "torch_version": torch.__version__,
        "blocks": blocks,
        "steps_per_block": steps,
        "step_seconds_median": {"unprofiled": statistics.median(plain_s),
                                "profiler_waiting": statistics.median(profiled_s)},
        "ratio_profiler_waiting_to_unprofiled": statistics.median(profiled_s) / statistics.median(plain_s),
        "ratio_profiler_waiting_to_unprofiled_paired": paired,
    }


def main():
    build = pathlib.Path(sys.argv[1])
    out = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else \
        pathlib.Path(__file__).resolve().parents[1] / "results" / "profile-overhead.json"
    binary = build / "bench" / "profile" / "kiln_bench_profile_overhead"
    kiln = {}
    for model in ("mlp", "gpt"):
        runs = []
        for _ in range(RUNS):
            run = subprocess.run([str(binary), model], capture_output=True, text=True, check=True)
            runs.append(json.loads(run.stdout))
        ratios = [r["ratio_profiler_waiting_to_unprofiled_paired"] for r in runs]
        controls = [r["ratio_control_to_unprofiled_paired"] for r in runs]
        kiln[model] = {
            "ratio_profiler_waiting_to_unprofiled_median": statistics.median(ratios),
            "ratio_profiler_waiting_to_unprofiled_runs": ratios,
            "ratio_control_to_unprofiled_runs": controls,
            "hook_ns_per_waiting_step_median": statistics.median(r["hook_ns_per_waiting_step"] for r in runs),
            "hook_share_of_unprofiled_step_median": statistics.median(r["hook_share_of_unprofiled_step"] for r in runs),
            "unprofiled_step_seconds_median": statistics.median(r["step_seconds_median"]["unprofiled"] for r in runs),
            "runs": runs,
        }
    result = {
        "what": "step time with the profiler attached and its schedule in the wait phase, over step time "
                "without it: per process, the median over rounds of the ratio of back-to-back blocks; "
                "the control is a second unprofiled trainer",
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "kiln": kiln,
        "python_torch_profiler_mlp": python_ratio(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for model in ("mlp", "gpt"):
        k = kiln[model]
        print(f"kiln {model}: waiting/unprofiled median {k['ratio_profiler_waiting_to_unprofiled_median']:.4f} over "
              f"{RUNS} runs {[round(r, 4) for r in k['ratio_profiler_waiting_to_unprofiled_runs']]}, "
              f"control {[round(r, 4) for r in k['ratio_control_to_unprofiled_runs']]}; "
              f"hook {k['hook_ns_per_waiting_step_median']:.1f} ns/step = "
              f"{100 * k['hook_share_of_unprofiled_step_median']:.4f}% of a "
              f"{1e3 * k['unprofiled_step_seconds_median']:.3f} ms step")
    p = result["python_torch_profiler_mlp"]
    print(f"python torch.profiler mlp: waiting/unprofiled {p['ratio_profiler_waiting_to_unprofiled_paired']:.4f}, "
          f"{1e3 * p['step_seconds_median']['unprofiled']:.3f} ms/step")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
