"""scripts/gpu-check --dry-run: the script's logic without a GPU (docs/gpu-check.md)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SOURCE = Path(os.environ["KILN_SOURCE_DIR"])
BUILD = Path(os.environ["KILN_BUILD_DIR"])
SCRIPT = SOURCE / "scripts" / "gpu-check"


def make_deps(folder: Path, dangling_link: bool = False) -> None:
    """A prepared folder with one real (tiny) .deb and its manifest, as --prepare writes it;
    with dangling_link, the package ships a `.so` link whose library is in no package."""
    pkg = folder / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr" / "include").mkdir(parents=True)
    (pkg / "usr" / "include" / "kiln_probe.h").write_text("#pragma once\n")
    if dangling_link:
        (pkg / "usr" / "lib").mkdir(parents=True)
        os.symlink("libkiln_probe.so.1", pkg / "usr" / "lib" / "libkiln_probe.so")
    (pkg / "DEBIAN" / "control").write_text(
        "Package: kiln-probe\nVersion: 1.0\nArchitecture: all\nMaintainer: kiln\n"
        "Description: test\n")
    deb = folder / "kiln-probe_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--build", str(pkg), str(deb)], check=True, capture_output=True)
    shutil.rmtree(pkg)
    digest = hashlib.sha256(deb.read_bytes()).hexdigest()
    manifest = {"packages": ["kiln-probe"], "total_bytes": deb.stat().st_size,
                "files": [{"name": deb.name, "bytes": deb.stat().st_size, "sha256": digest}]}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def python_without_torch():
    """A python3 (3.9 or later, as the script needs) that cannot import torch, or None."""
    probe = ("import sys, importlib.util; assert sys.version_info >= (3, 9); "
             "sys.exit(importlib.util.find_spec('torch') is not None)")
    for python in ("/usr/bin/python3", getattr(sys, "_base_executable", ""),
                   str(Path(sys.base_prefix) / "bin" / "python3")):
        if python and Path(python).exists() and subprocess.run(
                [python, "-c", probe], capture_output=True).returncode == 0:
            return python
    return None


class DryRun(unittest.TestCase):
    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="kiln-gpu-check-"))
        self.deps = self.tmp / "deps"
        self.deps.mkdir()
        make_deps(self.deps)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run_script(self, *extra):
        out = self.tmp / "out"
        shutil.rmtree(out, ignore_errors=True)
        run = subprocess.run([sys.executable, str(SCRIPT), str(out), "--dry-run", "--deps",
                              str(self.deps), "--build-dir", str(BUILD), *extra],
                             capture_output=True, text=True, timeout=100)
        doc = json.loads((out / "gpu-check.json").read_text())
        return run, {c["name"]: c for c in doc["checks"]}, doc

    def bare_checkout(self):
        """The script in a checkout with no build, no gpu-deps/ and no .venv: a fresh clone."""
        root = self.tmp / "clone"
        (root / "scripts").mkdir(parents=True)
        shutil.copy(SCRIPT, root / "scripts" / "gpu-check")
        for folder in ("configs", "bench"):
            (root / folder).symlink_to(SOURCE / folder)
        return root

    def test_a_dry_run_needs_nothing_but_the_checkout(self):
        # `scripts/gpu-check DIR --dry-run` as the docs write it, by a python3 that cannot import
        # torch, with no build and nothing prepared: every check planned, its commands printed,
        # what this machine lacks said, exit 0.
        python = python_without_torch()
        if python is None:
            self.skipTest("no python3 without torch on this machine")
        root, out = self.bare_checkout(), self.tmp / "bare"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.tmp)}
        run = subprocess.run([python, "scripts/gpu-check", str(out), "--dry-run"], cwd=root,
                             env=env, capture_output=True, text=True, timeout=100)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        checks = {c["name"]: c for c in json.loads((out / "gpu-check.json").read_text())["checks"]}
        self.assertEqual({n: c["status"] for n, c in checks.items()},
                         dict.fromkeys(["environment", "dependencies", "build", "cuda_tests",
                                        "ladder_preflight", "ladder", "python_peer"], "planned"))
        for name in checks:
            self.assertIn(f"[gpu-check] --- {name}\n", run.stdout)
        self.assertIn("cannot import torch (ModuleNotFoundError", checks["environment"]["warning"])
        self.assertIn("gpu-deps/manifest.json missing: not verified",
                      checks["dependencies"]["warning"])
        self.assertIn("--prepare", checks["dependencies"]["warning"])
        for name in ("cuda_tests", "ladder_preflight", "ladder"):
            self.assertIn("no kiln in", checks[name]["warning"])
        # What it would run, printed: the build, the tests, the ladder as the GPU runs it.
        self.assertIn("would run: cmake --build", run.stdout)
        self.assertIn("would run: ctest --test-dir", run.stdout)
        self.assertRegex(run.stdout, r"would run: \S+/kiln ladder \S+ --set run\.device=cuda ")
        self.assertIn("note: " + checks["dependencies"]["warning"], run.stdout)
        self.assertIn("every check planned (dry run); notes on environment", run.stdout)
        # The real run refuses on the same machine: no torch, nothing prepared (nothing is built).
        real = subprocess.run([python, "scripts/gpu-check", str(self.tmp / "real")], cwd=root,
                              env=env, capture_output=True, text=True, timeout=100)
        self.assertEqual(real.returncode, 1, real.stdout + real.stderr)
        checks = {c["name"]: c for c in
                  json.loads((self.tmp / "real" / "gpu-check.json").read_text())["checks"]}
        self.assertEqual(checks["environment"]["status"], "failed")
        self.assertIn("No module named 'torch'", checks["environment"]["error"])
        self.assertIn(checks["dependencies"]["status"], ("failed", "skipped"))
        self.assertNotIn("planned", {c["status"] for c in checks.values()})

    def test_a_dry_run_by_a_python_without_torch_probes_the_checkouts_venv(self):
        python = python_without_torch()
        if python is None:
            self.skipTest("no python3 without torch on this machine")
        out = self.tmp / "system"
        run = subprocess.run([python, str(SCRIPT), str(out), "--dry-run", "--deps",
                              str(self.tmp / "no-deps"), "--build-dir", str(BUILD)],
                             capture_output=True, text=True, timeout=100)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        checks = {c["name"]: c for c in json.loads((out / "gpu-check.json").read_text())["checks"]}
        self.assertEqual({c["status"] for c in checks.values()}, {"planned"}, checks)
        if (SOURCE / ".venv" / "bin" / "python").exists():
            self.assertIsNotNone(checks["environment"]["numbers"]["torch"])
        self.assertIn("ladder check passed", checks["ladder_preflight"]["numbers"]["preflight"])

    def test_plans_every_check_and_checks_what_it_can(self):
        run, checks, doc = self.run_script()
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertTrue(doc["dry_run"])
        self.assertEqual(list(checks), ["environment", "dependencies", "build", "cuda_tests",
                                        "ladder_preflight", "ladder", "python_peer"])
        for name, check in checks.items():
            self.assertEqual(check["status"], "planned", (name, check))
        deps = checks["dependencies"]
        self.assertEqual(deps["numbers"]["deb_files"], 1)
        self.assertTrue(any(c.startswith("dpkg -x") and "kiln-probe_1.0_all.deb" in c
                            for c in deps["commands"]), deps["commands"])
        self.assertTrue(any("googletest" in c for c in deps["commands"]))
        # Only what the GPU checks run, with every core, in the kept build directory.
        build = " ".join(checks["build"]["commands"])
        self.assertIn("--target kiln_cli kiln_cuda_tests -j", build)
        self.assertNotIn("kiln_tests ", build)
        self.assertIn("-DTORCH_CUDA_ARCH_LIST=9.0", build)
        # The cuda-labelled tests exist in this build, one per CUDA path.
        tests = checks["cuda_tests"]["numbers"]["tests"]
        for path in ("PeakMemory", "Pinned", "Nccl", "Profiler", "Bf16Mixed", "CapturedStep",
                     "CompileRung", "ManifestNamesTheGpu"):
            self.assertTrue(any(path in t for t in tests), (path, tests))
        # kiln's own ladder preflight accepted the production configuration (run here, on CPU).
        preflight = checks["ladder_preflight"]
        self.assertTrue(preflight["commands"][0].split()[1:2] == ["ladder"], preflight)
        self.assertIn("--check", preflight["commands"][0])
        self.assertIn("ladder check passed", preflight["numbers"]["preflight"])
        for key in ("train.precision=bf16-mixed", "compile.backend=inductor", "data.seq_len=1024",
                    "dist.backend=nccl"):
            self.assertIn(key, preflight["numbers"]["overrides"])
        peer = " ".join(checks["python_peer"]["commands"])
        self.assertIn("python_step.py", peer)
        self.assertIn("--precision bf16-mixed", peer)  # the ladder's own options
        self.assertIn("--compile", peer)
        # The stages fit the device budget (a machine start, then each stage within its limit).
        plan = doc["plan"]
        self.assertEqual(plan["problems"], [])
        self.assertLessEqual(plan["planned_seconds"], plan["budget_seconds"])
        for stage, limit in plan["stage_limit_seconds"].items():
            self.assertLessEqual(limit, 300, stage)

    def test_a_configuration_kiln_refuses_fails_the_dry_run(self):
        # A config rule's refusal (validate-time) and a preflight check's (the compile rung's
        # Python): either stops the ladder here, on CPU, before a GPU minute is spent.
        cases = {"train.batch_size": ["train.batch_size=0"],
                 "compile.python": ["compile.python=/nonexistent/python3"],
                 # compiled + checkpointed needs per-unit compilation: a whole-step graph
                 # (compile.granularity = "step") is refused by a rule
                 "train.activation_checkpointing": ["train.activation_checkpointing=block",
                                                    "compile.granularity=step"]}
        for key, extra in cases.items():
            args = [a for e in extra for a in ("--ladder-set", e)]
            run, checks, _ = self.run_script("--stage", "ladder", *args)
            self.assertEqual(run.returncode, 1, (extra, run.stdout + run.stderr))
            self.assertEqual(checks["ladder_preflight"]["status"], "failed", extra)
            self.assertIn("kiln exited 2", checks["ladder_preflight"]["error"])
            self.assertIn(key, checks["ladder_preflight"]["error"])
            self.assertEqual(checks["ladder"]["status"], "skipped", extra)
            self.assertIn("needs ladder_preflight", checks["ladder"]["error"])
            self.assertNotIn("build", checks)  # --stage ladder runs that stage only

    def test_a_dangling_library_link_is_named(self):
        shutil.rmtree(self.deps)
        self.deps.mkdir()
        make_deps(self.deps, dangling_link=True)
        run, checks, _ = self.run_script("--stage", "build")
        self.assertEqual(run.returncode, 1)
        self.assertEqual(checks["dependencies"]["status"], "failed")
        self.assertIn("usr/lib/libkiln_probe.so -> libkiln_probe.so.1",
                      checks["dependencies"]["error"])

    def test_an_unknown_stage_is_refused(self):
        run = subprocess.run([sys.executable, str(SCRIPT), str(self.tmp / "out"), "--dry-run",
                              "--stage", "bulid"], capture_output=True, text=True, timeout=60)
        self.assertEqual(run.returncode, 2)
        self.assertIn("unknown stage bulid", run.stderr)

    def test_a_failing_check_is_named_and_the_script_goes_on(self):
        run, checks, doc = self.run_script("--inject-failure", "dependencies")
        self.assertEqual(run.returncode, 1)
        self.assertEqual(checks["dependencies"]["status"], "failed")
        self.assertIn("injected failure", checks["dependencies"]["error"])
        self.assertEqual(checks["build"]["status"], "skipped")
        self.assertIn("needs dependencies", checks["build"]["error"])
        self.assertEqual(checks["cuda_tests"]["status"], "skipped")  # needs the build
        self.assertEqual(checks["environment"]["status"], "planned")
        self.assertEqual(doc["summary"]["failed"], 1)

    def test_a_changed_prepared_file_is_refused(self):
        deb = next(self.deps.glob("*.deb"))
        deb.write_bytes(deb.read_bytes() + b"x")
        run, checks, _ = self.run_script()
        self.assertEqual(run.returncode, 1)
        self.assertEqual(checks["dependencies"]["status"], "failed")
        self.assertIn("changed since --prepare", checks["dependencies"]["error"])


if __name__ == "__main__":
    unittest.main()
