"""AOTInductor packaging under generated-file names private to this process.

torch._inductor.aoti_compile_and_package writes a graph's C++ sources, metadata JSON and shared
library into Inductor's cache directory (shared by every process of the user) under a hash of the
generated code. Two processes compiling the same graph at once (ctest -j2 runs two compile tests
side by side) therefore write the same files, and one can rewrite a metadata JSON (opened "w":
truncated, then written) while the other is zipping it into its package; that package then fails
to load with "attempting to parse an empty input". Reproduced with two processes packaging one
small graph 40 times each: 2 of the 80 packages were broken, none once the names are private.

Here the generated files are named after this process and moment
(aot_inductor.model_name_for_generated_files), so no other process touches them, and they are
removed once packaged (the package holds its own copies). The compile costs the same: the shared
library is built on every call either way, and the rest of Inductor's cache stays shared (a private
cache directory per compile instead cost gpt tiny's step package 6.6 s more, 25.5 s against 18.9).
"""
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time


def compile_and_package(ep, path, configs):
    """aoti_compile_and_package(ep) into path with configs, under private generated-file names;
    returns the package path."""
    from torch._inductor import aoti_compile_and_package
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    os.makedirs(os.path.dirname(path), exist_ok=True)
    name = f"kiln_{os.getpid()}_{time.time_ns()}"
    try:
        return aoti_compile_and_package(
            ep, package_path=path,
            inductor_configs={**configs, "aot_inductor.model_name_for_generated_files": name})
    finally:
        # Inductor's layout: <cache>/<graph code hash>/<name>.* and <name>/ (the constants),
        # <cache>/locks/<name>.lock
        for leftover in glob.glob(os.path.join(cache_dir(), "*", glob.escape(name) + "*")):
            if os.path.isdir(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                try:
                    os.remove(leftover)
                except OSError:
                    pass


# ---- Inductor's vector-ISA checks, beside export ------------------------------------------------
#
# The first CPU lowering with an empty Inductor cache runs Inductor's vector-ISA checks: a small
# C++ file compiled with each ISA's flags the CPU claims (six g++ runs, ~6 s on these machines),
# serially, inside the lowering. Their outputs are cached on disk under a lock per check
# (torch/_inductor/cpu_vec_isa.py, VecISA.check_build), so a second process running the same
# checks waits for one in flight and reuses what was built. start_cpu_isa_probe runs them in a
# child process while this one exports; the lowering then finds them built (or builds the rest
# itself, as without the child: the child only saves time, it decides nothing). A child process,
# not a thread: a thread importing torch._inductor beside the main thread's export once saw a
# partly initialised module (ImportError: cannot import name 'IndentedBuffer', on CI).
#
# A marker in Inductor's cache directory (removed with it) records that the checks ran for this
# torch, CPU and compiler, so a warm machine starts no child (its `import torch` costs ~1.7 s of
# the other core). KILN_COMPILE_ISA_PROBE=0 turns the child off (the bench's control).

def _isa_marker():
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    import torch

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    what = "\n".join([torch.__version__, platform.machine(), flags, os.environ.get("CXX", ""),
                      os.environ.get("TORCHINDUCTOR_VEC_ISA_OK", "")])
    digest = hashlib.sha256(what.encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"kiln-vec-isa-checked-{digest}")


def start_cpu_isa_probe():
    """Starts Inductor's vector-ISA checks in a child process; returns it (None when off, when
    the marker says they ran, or when the child cannot start)."""
    if os.environ.get("KILN_COMPILE_ISA_PROBE", "1") == "0":
        return None
    marker = _isa_marker()
    if os.path.exists(marker):
        return None
    code = "from torch._inductor.cpu_vec_isa import pick_vec_isa\npick_vec_isa()\n"
    try:
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None
    child.kiln_marker = marker
    return child


def wait_cpu_isa_probe(child, timeout=120):
    """Waits for the child (killed past timeout); a clean exit writes the marker. Returns its
    exit status (None when there was no child)."""
    if child is None:
        return None
    try:
        code = child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()
    if code == 0:
        try:
            os.makedirs(os.path.dirname(child.kiln_marker), exist_ok=True)
            with open(child.kiln_marker, "w") as f:
                f.write("Inductor's vector-ISA checks ran here (kiln_py.aoti)\n")
        except OSError:
            pass
    return code
