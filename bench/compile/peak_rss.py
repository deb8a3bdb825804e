#!/usr/bin/env python3
"""Run one command and record its own peak resident set (VmHWM), for a rank under torchrun.

    torchrun ... bench/compile/peak_rss.py --out DIR -- <command> [args...]

Polls /proc/<pid>/status every 50 ms while the command runs; VmHWM never falls, so the last value
read is the process's peak (its children, e.g. a compiler subprocess, are not counted: getrusage's
RUSAGE_CHILDREN would take the largest of them). Writes DIR/rank<RANK>.json with the peak and the
exit status, and exits with the command's status. The same wrapper measures both sides of a bench.
"""
import json
import os
import subprocess
import sys
import time


def vm_hwm_bytes(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main():
    args = sys.argv[1:]
    if len(args) < 4 or args[0] != "--out" or args[2] != "--":
        raise SystemExit("usage: peak_rss.py --out DIR -- COMMAND [ARGS...]")
    out, command = args[1], args[3:]
    child = subprocess.Popen(command)
    peak = 0
    while child.poll() is None:
        peak = max(peak, vm_hwm_bytes(child.pid) or 0)
        time.sleep(0.05)
    os.makedirs(out, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": int(rank), "peak_rss_bytes": peak, "exit": child.returncode}, f)
    sys.exit(child.returncode)


if __name__ == "__main__":
    main()
