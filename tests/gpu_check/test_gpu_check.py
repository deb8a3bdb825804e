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


def make_deps(folder: Path) -> None:
    """A prepared folder with one real (tiny) .deb and its manifest, as --prepare writes it."""
    pkg = folder / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr" / "include").mkdir(parents=True)
    (pkg / "usr" / "include" / "kiln_probe.h").write_text("#pragma once\n")
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
        run = subprocess.run([sys.executable, str(SCRIPT), str(out), "--dry-run", "--deps",
                              str(self.deps), "--build-dir", str(BUILD), *extra],
                             capture_output=True, text=True, timeout=100)
        doc = json.loads((out / "gpu-check.json").read_text())
        return run, {c["name"]: c for c in doc["checks"]}, doc

    def test_plans_every_check_and_checks_what_it_can(self):
        run, checks, doc = self.run_script()
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertTrue(doc["dry_run"])
        self.assertEqual(list(checks), ["environment", "dependencies", "build", "cuda_tests",
                                        "ladder_gpt2_bf16"])
        for name, check in checks.items():
            self.assertEqual(check["status"], "planned", (name, check))
        deps = checks["dependencies"]
        self.assertEqual(deps["numbers"]["deb_files"], 1)
        self.assertTrue(any(c.startswith("dpkg -x") and "kiln-probe_1.0_all.deb" in c
                            for c in deps["commands"]), deps["commands"])
        self.assertTrue(any("googletest" in c for c in deps["commands"]))
        self.assertTrue(any("kiln_cuda_tests" in c for c in checks["build"]["commands"]))
        # The cuda-labelled tests exist in this build, one per CUDA path.
        tests = checks["cuda_tests"]["numbers"]["tests"]
        for path in ("PeakMemory", "Pinned", "Nccl", "Profiler", "Bf16Mixed", "CapturedStep",
                     "CompileRung"):
            self.assertTrue(any(path in t for t in tests), (path, tests))
        # The ladder's overrides name real keys (validated by this build's kiln).
        ladder = checks["ladder_gpt2_bf16"]["commands"]
        self.assertTrue(ladder[0].split()[1:3] == ["config", "validate"], ladder)
        self.assertIn("train.precision=bf16-mixed", ladder[1])
        self.assertIn("data.seq_len=1024", ladder[1])

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
