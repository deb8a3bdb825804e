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
import threading
import time

# One record per package built in this process: its C++ builds, each {"file", "seconds",
# "began"} (seconds since the package's build began), and whether the wrapper was built beside the
# kernel file. The compiler's result carries them ("cpp_builds").
CPP_BUILDS = []


def compile_and_package(ep, path, configs):
    """aoti_compile_and_package(ep) into path with configs, under private generated-file names;
    returns the package path."""
    from torch._inductor import aoti_compile_and_package
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    os.makedirs(os.path.dirname(path), exist_ok=True)
    name = f"kiln_{os.getpid()}_{time.time_ns()}"
    try:
        with WrapperBesideKernel(name) as builds:
            package = aoti_compile_and_package(
                ep, package_path=path,
                inductor_configs={**configs, "aot_inductor.model_name_for_generated_files": name})
        CPP_BUILDS.append(builds.record)
        return package
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


# ---- the wrapper's C++ compile beside the kernel file's ---------------------------------------
#
# AOTInductor (torch/_inductor/codecache.py, AotCodeCompiler.compile) writes a package's C++ as two
# translation units, the wrapper (<name>.wrapper.cpp: the graph's run function) and the kernels
# (<name>.kernel.cpp), then compiles them with two g++ runs one after the other
# (wrapper_builder.build(); kernel_builder.build()) and links them (a third build, named after the
# wrapper, writing <name>.wrapper.so). The two compiles are independent: each reads only its own
# source and headers and writes its own object file, which only the link after them reads. Here
# the wrapper object's build (<name>.wrapper.o) starts in a thread (the g++ child runs outside the
# GIL) and returns at once; the kernel file's build runs as before, and the wrapper's is joined
# before anything else builds (the link) and before the package is zipped. The commands are
# torch's own, unchanged, on the same sources. On a torch that names or orders its builds
# otherwise, nothing matches the wrapper object's name and every build runs as before.
# KILN_COMPILE_CPP_SIDE_BY_SIDE=0 builds them one after the other (the bench's control).

class WrapperBesideKernel:
    def __init__(self, name):
        self.name = name
        self.side_by_side = os.environ.get("KILN_COMPILE_CPP_SIDE_BY_SIDE", "1") != "0"
        self.record = {"side_by_side": self.side_by_side, "builds": []}
        self.pending = None
        self.started = False
        self.began = time.perf_counter()

    def _timed(self, original, builder):
        began = time.perf_counter()
        original(builder)
        target = os.path.basename(builder.get_target_file_path())
        if target.startswith(self.name):
            target = target[len(self.name):].lstrip("._") or target
        self.record["builds"].append({"file": target,
                                      "began": round(began - self.began, 3),
                                      "seconds": round(time.perf_counter() - began, 3)})

    def _join(self):
        if self.pending is None:
            return
        thread, failure = self.pending
        self.pending = None
        thread.join()
        if failure:
            raise failure[0]

    def __enter__(self):
        from torch._inductor import cpp_builder
        self.cls = cpp_builder.CppBuilder
        self.original = self.cls.build
        outer, original = self, self.cls.build

        def build(builder):
            target = os.path.basename(builder.get_target_file_path())
            if outer.side_by_side and target == f"{outer.name}.wrapper.o" and not outer.started:
                outer.started = True
                failure = []

                def work():
                    try:
                        outer._timed(original, builder)
                    except BaseException as e:  # re-raised by _join, in the caller's thread
                        failure.append(e)

                thread = threading.Thread(target=work, name="kiln-aoti-wrapper", daemon=True)
                outer.pending = (thread, failure)
                thread.start()
                return
            if target != f"{outer.name}.kernel.o":
                outer._join()  # the link (or anything else) reads the wrapper's object
            try:
                outer._timed(original, builder)
            finally:
                outer._join()

        self.cls.build = build
        return self

    def __exit__(self, kind, value, tb):
        self.cls.build = self.original
        try:
            self._join()
        except BaseException:
            if kind is None:
                raise
        return False


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

# The child's program. Inductor checks the ISAs one after the other (valid_vec_isa_list: each
# candidate's bool() compiles its test code, then its extensions'); the candidates' chains are
# independent (each check has its own file and lock), so the child runs one thread per candidate
# the CPU claims (the g++ runs are child processes, outside the GIL), then pick_vec_isa() as
# before, which finds them built. 6 checks on 2 cores (AVX-512 EPYC): 3.8 s instead of 7.5 s.
ISA_CHILD_CODE = """
import platform, threading
from torch._inductor import cpu_vec_isa
if platform.machine() in ("x86_64", "AMD64"):
    have = cpu_vec_isa.x86_isa_checker()
    todo = [isa for isa in cpu_vec_isa.supported_vec_isa_list
            if all(flag in have for flag in str(isa).split())]
    threads = [threading.Thread(target=bool, args=(isa,)) for isa in todo]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
cpu_vec_isa.pick_vec_isa()
"""


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
    code = ISA_CHILD_CODE
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
