"""report.html in a real browser, checked on values (CTest: report.ladder, report.html_in_chromium,
report.comparison_in_chromium; docs/report.md).

- report.ladder (a CTest fixture) runs the demo's ladder once (configs/demo.toml, the compile rung
  left out for time) into the build tree; the tests below only read it. It checks the ladder:
  every enabled rung ran in order and passed, report.md agrees with each <rung>.json, the scale
  rung's ranks ran under torchrun as a run of their own (<run>/scale/), and the demo's training
  curve is clean (no step's loss more than 0.5 above the lowest before it).
- headless Chromium renders the run's report.html (Debian's chromium and Chart.js, installed by
  scripts/setup: the test fails when either is missing) with no console error; the test reads back
  from the rendered page the scorecard's numbers (against each <rung>.json), the identity (against
  manifest.json), each chart's data points (against metrics-baseline.jsonl and the rung files),
  the plan's rows with the recommended one marked, and that the log-scale box switches the axis.
- the comparison page of that run and a changed copy of it: each rung's numbers in A and B with
  their difference, the config keys that differ, both runs' curves overlaid.

Environment (tests/report/CMakeLists.txt): KILN_CLI, KILN_CHARTJS, KILN_TORCHRUN, KILN_SOURCE_DIR,
KILN_REPORT_LADDER (the fixture's run directory), KILN_REPORT_WORK (scratch; the screenshots stay).
"""

import html as html_module
import json
import os
import re
import shutil
import subprocess
import unittest
from pathlib import Path

KILN = os.environ.get("KILN_CLI", "")
WORK = Path(os.environ.get("KILN_REPORT_WORK", "/tmp/kiln-report-test"))
LADDER = Path(os.environ.get("KILN_REPORT_LADDER", "/tmp/kiln-report-ladder"))
SOURCE = Path(os.environ.get("KILN_SOURCE_DIR", Path(__file__).resolve().parents[2]))
CHARTJS = os.environ.get("KILN_CHARTJS") or "/usr/share/javascript/chart.js/chart.min.js"
RUN = LADDER / "runs" / "demo"
RUNGS = ["baseline", "compile", "profile", "scale", "checkpoint", "pilot", "plan"]


def run(args, expect=0):
    """Runs a command; fails the test with its output when the exit status is not `expect`."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if done.returncode != expect:
        raise AssertionError(f"{' '.join(map(str, args))}: exit {done.returncode}, expected {expect}\n"
                             f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}")
    return done


def fresh(name):
    path = WORK / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def records(path):
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


class LadderFixture(unittest.TestCase):
    def test_run_the_demo_ladder(self):
        shutil.rmtree(LADDER, ignore_errors=True)
        LADDER.mkdir(parents=True)
        run([KILN, "ladder", SOURCE / "configs" / "demo.toml",
             "--set", f"run.dir={LADDER / 'runs'}", "--set", "run.progress=off",
             "--set", 'compile.backend="eager"',  # the compile rung: compiled_step tests (time)
             "--set", f"dist.torchrun={os.environ['KILN_TORCHRUN']}",
             # Shorter than the demo where the curve check does not look (time): the baseline
             # still passes the warm-up (20 steps), where lr 3e-3 spiked.
             "--set", "baseline.steps=25", "--set", "checkpoint.drill_steps=2",
             "--set", "dist.scale_steps=4", "--set", "dist.scale_warmup_steps=1",
             "--set", "dist.scale_baseline_steps=3", "--set", "profile.skip_first=1",
             "--set", "profile.warmup=1", "--set", "profile.active=2",
             # Prices for two rows: the plan recommends by cost.
             "--set", "plan.price_7d_per_gpu_hour={ h100-sxm = 2.99, mi300x = 2.5 }"])
        # Every enabled rung ran, in ladder order, and passed; report.md has its row (its file's
        # gate and verdict), its section and its numbers' file.
        ran = ["baseline", "profile", "scale", "checkpoint", "pilot", "plan"]
        report = (RUN / "report.md").read_text()
        self.assertEqual(re.findall(r"(?m)^\| (\w+) \| (?:passed|\*\*failed\*\*) \|", report), ran)
        self.assertIn("tokens/s", report)
        for rung in ran:
            numbers = json.loads((RUN / f"{rung}.json").read_text())
            self.assertTrue(numbers["passed"], rung)
            verdict = numbers["verdict"]  # the profile's is an object with its reason
            verdict = verdict["reason"] if isinstance(verdict, dict) else verdict
            self.assertIn(f"| {rung} | passed | {verdict} |\n", report)
            self.assertIn(f"\n## {rung}\n\n| measure | value |\n", report)
            self.assertIn(f"Numbers: `{rung}.json`.", report)
        self.assertFalse((RUN / "compile.json").exists())

        # The scale rung launched its ranks with torchrun as a run of their own in <run>/scale/;
        # <run>/scale.json is their scale.json's copy; the ladder's own files stay the ladder's.
        scale = json.loads((RUN / "scale.json").read_text())
        ranks = json.loads((RUN / "scale" / "scale.json").read_text())
        self.assertEqual(scale["ranks_run_dir"], str(RUN / "scale"))
        self.assertEqual(ranks["weights_hash"], scale["weights_hash"])
        manifest = json.loads((RUN / "manifest.json").read_text())
        self.assertEqual((manifest["world_size"], manifest["config"]["file"]),
                         (1, str(SOURCE / "configs" / "demo.toml")))
        ranks_manifest = json.loads((RUN / "scale" / "manifest.json").read_text())
        self.assertEqual(ranks_manifest["world_size"], 2)
        self.assertTrue(ranks_manifest["config"]["file"].endswith("scale/scale-launch.toml"))
        self.assertFalse((RUN / "metrics.jsonl").exists())
        self.assertEqual(len(records(RUN / "scale" / "metrics-scale.jsonl")), scale["measured_steps"])
        self.assertNotIn('name = "scale"', (RUN / "config.toml").read_text())
        self.assertEqual((scale["world_size"], len(scale["per_rank"])), (2, 2))
        self.assertTrue(scale["replicas_in_sync"])
        self.assertGreater(scale["scaling_efficiency"], 0)
        for r in scale["per_rank"]:
            self.assertGreater(r["comm"]["collectives"], 0)
            self.assertGreater(r["compute_seconds"], 0)

        # The demo's curve, the first thing a new user sees, is clean: no spike above the lowest
        # loss so far (lr 3e-3 during warm-up once jumped from 3.5 to 7.2 at step 15).
        losses = [r["loss"] for r in records(RUN / "metrics-baseline.jsonl") if "loss" in r]
        self.assertGreater(len(losses), 25)
        for k in range(1, len(losses)):
            self.assertLess(losses[k], min(losses[:k]) + 0.5, f"loss spikes at record {k}: {losses}")
        self.assertLess(losses[-1], losses[0] - 1.0, losses)


# Appended to a copy of the page: reads Chart.js's live chart objects, the scorecard, the
# identity, the comparison and plan tables, clicks the log-scale box, and collects page errors.
PROBE_HEAD = """<script>window.__kilnErrors = [];
console.error = function() { window.__kilnErrors.push(Array.from(arguments).join(' ')); };
window.addEventListener('error', function(e) { window.__kilnErrors.push(String(e.message)); });
</script>"""
PROBE_TAIL = """<script>(function() {
  function text(e) { return e ? e.textContent.trim() : null; }
  function exact(e) { return e && e.dataset.exact !== '' ? Number(e.dataset.exact) : null; }
  var charts = window.Chart ? Object.values(Chart.instances) : [];
  var out = {version: window.Chart ? Chart.version : null, errors: window.__kilnErrors,
    charts: charts.map(function(c) { return {id: c.canvas.id, type: c.config.type,
      title: c.options.plugins.title.text,
      labels: c.data.labels || [],
      datasets: c.data.datasets.map(function(d, i) {
        return {label: d.label, data: d.data, drawn: c.getDatasetMeta(i).data.length}; })}; }),
    firstSection: document.querySelector('section') ? document.querySelector('section').id : null,
    scorecard: Array.from(document.querySelectorAll('table.scorecard tr.rung')).map(function(tr) {
      return {rung: tr.dataset.rung, status: text(tr.querySelector('td.status')),
        decision: text(tr.querySelector('td.decision')), key: text(tr.querySelector('td.key')),
        link: tr.querySelector('a') ? tr.querySelector('a').getAttribute('href') : null,
        figures: Array.from(tr.querySelectorAll('.figure')).map(function(f) {
          return {name: f.dataset.name, text: text(f), exact: exact(f)}; })}; }),
    identity: Array.from(document.querySelectorAll('table.identity tr')).map(function(tr) {
      return {name: tr.dataset.name, values: Array.from(tr.querySelectorAll('td')).map(text)}; }),
    compare: Array.from(document.querySelectorAll('table.comparison tr.compare')).map(function(tr) {
      return {rung: tr.dataset.rung, name: tr.dataset.name, a: exact(tr.querySelector('td.a')),
        b: exact(tr.querySelector('td.b')), aText: text(tr.querySelector('td.a')),
        bText: text(tr.querySelector('td.b')), difference: text(tr.querySelector('td.difference'))}; }),
    configDifferences: Array.from(document.querySelectorAll('table.config-differences tr.row')).map(
      function(tr) { return Array.from(tr.cells).map(text); }),
    planRows: Array.from(document.querySelectorAll('table.plan tr.row')).map(function(tr) {
      return {hardware: text(tr.cells[0]), chosen: tr.classList.contains('chosen')}; })};
  var box = document.querySelector('input.log-scale');
  if (box) {
    box.click();
    out.logScale = {chart: box.dataset.chart, type: Chart.getChart(box.dataset.chart).options.scales.y.type};
  }
  var pre = document.createElement('pre'); pre.id = 'kiln-probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();</script>"""


def chromium_binary():
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    raise AssertionError("Chromium is missing: run scripts/setup (it installs Debian's chromium)")


def chromium(*args):
    return run([chromium_binary(), "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--hide-scrollbars", *args])


def probe(page_path, work):
    """The page rendered by headless Chromium, as the probe read it."""
    page = page_path.read_text()
    library = Path(CHARTJS).read_text()
    # Raised, not asserted: python -O strips assert statements.
    if library not in page:
        raise AssertionError("Debian's Chart.js is not inlined verbatim")
    if re.search(r"<script[^>]+src=", page):
        raise AssertionError("the page fetches a script")
    copy = work / "probe.html"
    copy.write_text(page.replace("<head>", "<head>" + PROBE_HEAD, 1)
                    .replace("</body>", PROBE_TAIL + "</body>", 1))
    dom = chromium("--virtual-time-budget=10000", "--dump-dom", copy.as_uri()).stdout
    found = re.search(r'<pre id="kiln-probe">(.*?)</pre>', dom, re.S)
    if not found:
        raise AssertionError(dom[-2000:])
    result = json.loads(html_module.unescape(found.group(1)))
    result["library_version"] = re.search(r"Chart\.js v(\d+\.\d+\.\d+)", library).group(1)
    return result


def points(path, key):
    return [{"x": r["step"], "y": r[key]} for r in records(path) if key in r]


class Report(unittest.TestCase):
    def load(self, name):
        path = RUN / name
        return json.loads(path.read_text()) if path.exists() else None

    def test_report_in_chromium(self):
        chromium_binary()  # fails, not skips, when missing
        self.assertTrue((RUN / "report.html").exists())  # the ladder wrote it
        work = fresh("html")
        kiln = run([KILN, "report", RUN, "--out", work])
        self.assertIn("not in this run: compile.json", kiln.stdout)
        result = probe(work / "report.html", work)
        self.assertEqual(result["errors"], [])
        self.assertEqual(result["version"], result["library_version"])
        self.assertEqual(result["firstSection"], "scorecard")

        # The scorecard: a row per rung in ladder order, each status and number from its file.
        card = {row["rung"]: row for row in result["scorecard"]}
        self.assertEqual([row["rung"] for row in result["scorecard"]], RUNGS)
        figures = {rung: {f["name"]: f for f in row["figures"]} for rung, row in card.items()}
        for rung in RUNGS:
            numbers = self.load(f"{rung}.json")
            if numbers is None:
                self.assertEqual(card[rung]["status"], "not run", rung)
                continue
            self.assertEqual(card[rung]["status"], "passed" if numbers["passed"] else "FAILED", rung)
            self.assertEqual(card[rung]["link"], f"#{rung}", rung)
        baseline, scale, pilot = self.load("baseline.json"), self.load("scale.json"), self.load("pilot.json")
        profile, checkpoint, plan = self.load("profile.json"), self.load("checkpoint.json"), self.load("plan.json")
        shown = figures["baseline"]["tokens_per_second"]
        self.assertEqual(shown["exact"], baseline["tokens_per_second"])
        self.assertEqual(shown["text"], f"{baseline['tokens_per_second']:.0f} tokens/s")
        self.assertEqual(figures["baseline"]["mfu"]["exact"], baseline["mfu"])  # null on a CPU
        self.assertEqual(figures["scale"]["scaling_efficiency"]["exact"], scale["scaling_efficiency"])
        self.assertEqual(figures["scale"]["scaling_efficiency"]["text"],
                         f"{100 * scale['scaling_efficiency']:.1f}% scaling efficiency")
        self.assertEqual(card["scale"]["key"], f'dist.strategy = "{scale["strategy"]}"')
        self.assertEqual(figures["profile"]["bottleneck"]["text"], profile["verdict"]["bottleneck"])
        self.assertEqual(card["profile"]["decision"], profile["verdict"]["actions"][0])
        self.assertEqual(figures["checkpoint"]["save_seconds"]["exact"], checkpoint["save_seconds"])
        self.assertEqual(figures["pilot"]["measured_peak_bytes"]["exact"],
                         pilot["memory"]["measured"]["peak_bytes"])
        self.assertEqual(figures["pilot"]["estimated_peak_bytes"]["exact"],
                         pilot["memory"]["estimate_step_peak_bytes"])
        self.assertIn(f"x {plan['recommendation']['hardware']},", figures["plan"]["recommended"]["text"])
        self.assertEqual(card["plan"]["decision"], plan["recommendation_text"])

        # The run's identity, from manifest.json.
        manifest = self.load("manifest.json")
        identity = {row["name"]: row["values"][0] for row in result["identity"]}
        self.assertTrue(identity["commit"].startswith(manifest["kiln"]["git_commit"]))
        self.assertTrue(identity["config_hash"].startswith(manifest["config"]["hash_xxh64"]))
        self.assertIn(manifest["device"], identity["device"])

        # The charts' data points, against the files they come from.
        charts = {c["id"]: c for c in result["charts"]}
        self.assertEqual(sorted(charts), sorted([
            "chart-training-loss", "chart-training-throughput", "chart-training-optimizer",
            "chart-profile-phases", "chart-scale-throughput", "chart-scale-phases",
            "chart-pilot-memory"]))
        for chart in charts.values():  # every point is drawn
            for d in chart["datasets"]:
                self.assertEqual(d["drawn"], len(d["data"]), (chart["id"], d["label"]))
        metrics = RUN / "metrics-baseline.jsonl"
        loss = {d["label"]: d["data"] for d in charts["chart-training-loss"]["datasets"]}
        self.assertEqual(loss["train loss"], points(metrics, "loss"))
        # The ladder's baseline evaluates before and after: baseline.json's, at step 0 and the last.
        self.assertEqual(loss["validation loss (baseline.json: before, after)"],
                         [{"x": 0, "y": baseline["val_loss_initial"]},
                          {"x": loss["train loss"][-1]["x"], "y": baseline["val_loss_final"]}])
        self.assertEqual(charts["chart-training-throughput"]["datasets"][0]["data"],
                         points(metrics, "tokens_per_second"))
        self.assertEqual(charts["chart-scale-throughput"]["datasets"][0]["data"],
                         [r["tokens_per_second"] for r in scale["per_rank"]])
        optimizer = {d["label"]: d["data"] for d in charts["chart-training-optimizer"]["datasets"]}
        self.assertEqual(optimizer["learning rate"], points(metrics, "lr"))
        self.assertEqual(optimizer["gradient norm (before clipping)"], points(metrics, "grad_norm"))
        # Step-time bars are per step (the files sum over the measured steps), so a rank's bars
        # add up to about its median step, the figure the text gives.
        exposed = {d["label"]: d["data"] for d in charts["chart-scale-phases"]["datasets"]}
        self.assertEqual(exposed["exposed communication"],
                         [r["phase_seconds"]["comm_exposed"] / scale["measured_steps"]
                          for r in scale["per_rank"]])
        for r, rank in enumerate(scale["per_rank"]):
            bars = sum(data[r] for data in exposed.values())
            self.assertLess(bars, 2 * rank["step_seconds"]["median"], rank)
        phases = {d["label"].split(" (")[0]: d["data"] for d in charts["chart-profile-phases"]["datasets"]}
        steps = profile["analysis"]["steps"]
        self.assertEqual(phases, {p["phase"]: [p["seconds"] / steps]
                                  for p in profile["analysis"]["phases"]})
        # The pilot's memory in the unit its title names; the step peak as its own pair of bars.
        memory = {d["label"]: d["data"] for d in charts["chart-pilot-memory"]["datasets"]}
        estimate, measured = pilot["memory"]["estimate"], pilot["memory"]["measured"]
        peak = max(estimate["step_peak_bytes"], measured["peak_bytes"])
        unit, scale_by = ("GB", 1e9) if peak >= 1e9 else ("MB", 1e6) if peak >= 1e6 else ("kB", 1e3)
        self.assertIn(f", {unit}:", charts["chart-pilot-memory"]["title"])
        self.assertEqual(memory["estimated"], [
            estimate["parameters_bytes"] / scale_by, estimate["gradients_bytes"] / scale_by,
            estimate["optimizer_bytes"] / scale_by,
            (estimate["activations_bytes"] + estimate["logits_bytes"]) / scale_by,
            estimate["step_peak_bytes"] / scale_by])
        self.assertEqual(memory["measured"][-1], measured["peak_bytes"] / scale_by)
        self.assertEqual(result["logScale"], {"chart": "chart-training-loss", "type": "logarithmic"})

        # The plan's table: a row per hardware row, the recommended one marked.
        rows = result["planRows"]
        self.assertEqual([r["hardware"].split(" ")[0] for r in rows], [r["hardware"] for r in plan["rows"]])
        self.assertEqual([r["hardware"].split(" ")[0] for r in rows if r["chosen"]],
                         [plan["recommendation"]["hardware"]])

        # The screenshot (scripts/report-screenshot makes the README's from runs/demo).
        shot = WORK / "report.png"
        chromium("--window-size=1400,1600", f"--screenshot={shot}", (work / "report.html").as_uri())
        self.assertGreater(shot.stat().st_size, 20000)

    def test_comparison_in_chromium(self):
        chromium_binary()
        work = fresh("compare")
        # B: the same run with a faster baseline, another learning rate and lower losses.
        b = work / "b"
        shutil.copytree(RUN, b, ignore=shutil.ignore_patterns("checkpoints", "traces", "scale",
                                                              "checkpoint-drill", "*.lock"))
        baseline = json.loads((b / "baseline.json").read_text())
        baseline["tokens_per_second"] *= 1.1
        (b / "baseline.json").write_text(json.dumps(baseline))
        config = (b / "config.toml").read_text()
        self.assertRegex(config, r"(?m)^lr = 0\.001 ")
        (b / "config.toml").write_text(re.sub(r"(?m)^lr = 0\.001 ", "lr = 0.0005 ", config))
        lines = records(b / "metrics-baseline.jsonl")
        for r in lines:
            if "loss" in r:
                r["loss"] -= 0.25
        (b / "metrics-baseline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))

        run([KILN, "report", RUN, b, "--out", work / "out"])
        result = probe(work / "out" / "report.html", work)
        self.assertEqual(result["errors"], [])
        rows = {(r["rung"], r["name"]): r for r in result["compare"]}
        a_rate = self.load("baseline.json")["tokens_per_second"]
        row = rows[("baseline", "tokens_per_second")]
        self.assertEqual((row["a"], row["b"]), (a_rate, baseline["tokens_per_second"]))
        self.assertRegex(row["difference"], r"^\+[0-9.e+]+ \(\+10\.0%\)$")
        self.assertEqual(rows[("baseline", "status")]["difference"], "same")
        self.assertEqual(rows[("scale", "scaling_efficiency")]["difference"], "+0 (+0.0%)")
        self.assertEqual(sorted({r["rung"] for r in result["compare"]}),
                         sorted(["baseline", "profile", "scale", "checkpoint", "pilot", "plan"]))
        self.assertEqual(result["configDifferences"], [["optim.lr", "0.001", "0.0005"]])
        charts = {c["id"]: {d["label"]: d["data"] for d in c["datasets"]} for c in result["charts"]}
        self.assertEqual(charts["chart-compare-loss"]["A: train loss"], points(RUN / "metrics-baseline.jsonl", "loss"))
        self.assertEqual(charts["chart-compare-loss"]["B: train loss"], points(b / "metrics-baseline.jsonl", "loss"))
        self.assertEqual(charts["chart-compare-throughput"]["B: tokens/s"],
                         points(b / "metrics-baseline.jsonl", "tokens_per_second"))
        shot = WORK / "comparison.png"
        chromium("--window-size=1400,1600", f"--screenshot={shot}", (work / "out" / "report.html").as_uri())


if __name__ == "__main__":
    unittest.main()
