"""Every documented `kiln` command marked runnable works as written (docs/config.md, "Runnable
examples").

A fence whose info string holds the word `runnable` (```sh runnable) is run line by line, in page
order, in one scratch directory per page: `configs/` and `examples/` link to the source tree's,
`build/kiln` and a bare `kiln` are the built CLI, `/tmp/` paths are mapped into the scratch
directory, and KILN_SET shrinks step counts. Each command must exit 0. A runnable line is a kiln
command, or two kiln processes under `torchrun --standalone --nproc-per-node=2 --no-python
build/kiln` (the torchrun beside this test's Python).

Every shell fence (sh, bash, shell, console) is either runnable or excused: ```sh skip: <reason>
(needs a GPU, two nodes, minutes of compiling, a user's own file, ...); an unmarked shell fence
or a `skip:` without its reason fails the test, naming the page and line.

    test_docs.py --kiln build/kiln --source . [--page docs/plan.md ...]
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

# Tiny step counts for every config-taking command (KILN_SET wins over the command's --set).
KILN_SET = " ".join([
    "train.steps=3", "train.eval_batches=1", "train.batch_size=2", "data.seq_len=32",
    "data.num_workers=0", "run.threads=1", "baseline.warmup_steps=1", "baseline.steps=3",
    "profile.skip_first=0", "profile.warmup=1", "profile.active=2", "pilot.steps=2",
    "run.progress=off",
])

# A runnable line: the CLI, or two of its processes on this machine.
RUNNABLE_LINE = (r"^((build/)?kiln "
                 r"|torchrun --standalone --nproc-per-node=2 --no-python (build/)?kiln )")

ARGS = None


def runnable_commands(page):
    """The commands of the page's runnable fences: (line number, command), continuations joined."""
    commands, fence, pending, start = [], None, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].split()
            continue
        if fence is None or fence[1:2] != ["runnable"]:  # "```sh runnable"; not in a skip's reason
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command and not command.startswith("#"):
            commands.append((start, command))
    return commands


SHELL_LANGUAGES = ("sh", "bash", "shell", "console")


def unexcused_shell_fences(page):
    """The opening lines of shell fences neither runnable nor `skip: <reason>`: page:line."""
    offenders, inside = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if not line.startswith("```"):
            continue
        if inside:
            inside = False
            continue
        inside = True
        info = line[3:].strip()
        words = info.split()
        if not words or words[0] not in SHELL_LANGUAGES or words[1:2] == ["runnable"]:
            continue
        rest = info[len(words[0]):].strip()
        if not (rest.startswith("skip:") and rest[len("skip:"):].strip()):
            offenders.append(f"{page.name}:{number}: {line}")
    return offenders


def pages(source):
    return [source / "README.md"] + sorted((source / "docs").glob("*.md"))


class RunnableExamples(unittest.TestCase):
    def test_a_marked_fence_is_found_and_only_marked_ones(self):
        with tempfile.TemporaryDirectory() as scratch:
            page = Path(scratch) / "page.md"
            page.write_text("```sh\nkiln train a.toml\n```\n```sh runnable\nkiln train b.toml   # c\n"
                            "kiln plan x \\\n  --cost y\n```\n")
            self.assertEqual(runnable_commands(page),
                             [(5, "kiln train b.toml   # c"), (6, "kiln plan x    --cost y")])

    def test_an_unmarked_shell_fence_or_a_skip_without_reason_is_named(self):
        with tempfile.TemporaryDirectory() as scratch:
            page = Path(scratch) / "page.md"
            page.write_text("```sh\nkiln a\n```\n```sh runnable\nkiln b\n```\n"
                            "```sh skip: needs a GPU\nkiln c\n```\n```bash skip:\nkiln d\n```\n"
                            "```toml\n[x]\n```\n```\noutput\n```\n")
            self.assertEqual(unexcused_shell_fences(page),
                             ["page.md:1: ```sh", "page.md:10: ```bash skip:"])

    def test_every_shell_fence_is_runnable_or_excused(self):
        source = Path(ARGS.source).resolve()
        offenders = [o for page in pages(source) for o in unexcused_shell_fences(page)]
        self.assertEqual(offenders, [], "mark each shell fence `runnable` or `skip: <reason>`")

    def test_every_runnable_command_exits_0(self):
        source, kiln = Path(ARGS.source).resolve(), Path(ARGS.kiln).resolve()
        chosen = [source / p for p in ARGS.pages] if ARGS.pages else pages(source)
        found = 0
        for page in chosen:
            commands = runnable_commands(page)
            found += len(commands)
            if not commands:
                continue
            with tempfile.TemporaryDirectory() as scratch:
                scratch = Path(scratch)
                (scratch / "configs").symlink_to(source / "configs")
                (scratch / "examples").symlink_to(source / "examples")
                (scratch / "build").mkdir()
                (scratch / "build" / "kiln").symlink_to(kiln)
                (scratch / "tmp").mkdir()
                path = f"{scratch / 'build'}:{Path(sys.executable).parent}"  # kiln, torchrun
                env = dict(os.environ, KILN_SET=KILN_SET,
                           PATH=f"{path}:{os.environ.get('PATH', '')}")
                env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as scripts/test: no spinning
                for number, command in commands:
                    self.assertRegex(command, RUNNABLE_LINE,
                                     f"{page.name}:{number}: a runnable fence holds kiln commands")
                    shell = re.sub(r"(?<![\w/.])/tmp/", f"{scratch}/tmp/", command)
                    begin = time.monotonic()
                    r = subprocess.run(["bash", "-c", shell], cwd=scratch, env=env,
                                       capture_output=True, text=True, timeout=300)
                    print(f"{page.relative_to(source)}:{number} exit {r.returncode} in "
                          f"{time.monotonic() - begin:.1f} s: {command}", file=sys.stderr)
                    self.assertEqual(r.returncode, 0,
                                     f"{page.relative_to(source)}:{number}: {command}\n{r.stderr[-3000:]}")
        if not ARGS.pages:
            self.assertGreater(found, 0, "no fence is marked runnable")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kiln", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--page", dest="pages", action="append", default=[],
                        help="a page relative to --source (repeatable; default: every page)")
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest)
