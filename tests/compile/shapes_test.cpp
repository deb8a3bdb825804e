// The compiled step's bookkeeping, without compiling: shapes and recompiles for each dynamic
// setting and the recompile limit, graph-break text, probe lengths, the package cache (hit,
// miss, stale, corrupt), the compiler Python's checks.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/headeronly/version.h>

#include "compile/internal.h"
#include "core/files.h"
#include "kiln/compile.h"
#include "kiln/error.h"
#include "support/helpers.h"

namespace kiln {
namespace {

using testing::slurp;
using testing::TempDir;
using testing::write_text;
using D = CompileOptions::Dynamic;

InputShapes tokens(int64_t batch, int64_t seq) {
  return {{batch, seq}, {batch, seq}};
}

// Feeds the rung's shapes (the training shape, then the probe's seq_len/2 and seq_len/4) and
// returns the tracker.
ShapeTracker feed(D dynamic, int limit, const std::vector<InputShapes>& shapes) {
  ShapeTracker tracker(dynamic, limit, /*max_seq_len=*/16);
  for (int pass = 0; pass < 2; ++pass) {  // the second pass must reuse or stay eager
    for (const InputShapes& s : shapes) tracker.record(s, tracker.decide(s));
  }
  return tracker;
}

const std::vector<InputShapes> kProbe = {tokens(4, 16), tokens(4, 8), tokens(4, 4)};

TEST(ShapeTracker, StaticBuildsAGraphPerShapeAndCountsEachRecompile) {
  const ShapeTracker t = feed(D::kStatic, 8, kProbe);
  ASSERT_EQ(t.graphs().size(), 3u);
  ASSERT_EQ(t.recompiles().size(), 2u);
  EXPECT_TRUE(t.graphs()[1].dynamic.empty());
  EXPECT_NE(t.recompiles()[0].reason.find(
                "inputs dim 1 changed 16 -> 8 (seq), targets dim 1 changed 16 -> 8 (seq): a static "
                "graph for inputs [4, 8], targets [4, 8]"),
            std::string::npos)
      << t.recompiles()[0].reason;
  EXPECT_NE(t.recompiles()[1].reason.find("16 -> 4"), std::string::npos);
  EXPECT_TRUE(t.recompiles()[0].compiled);
}

TEST(ShapeTracker, DynamicBuildsOneGraphForTheWholeRange) {
  const ShapeTracker t = feed(D::kDynamic, 8, kProbe);
  ASSERT_EQ(t.graphs().size(), 1u);
  EXPECT_TRUE(t.recompiles().empty());
  EXPECT_EQ(t.graphs()[0].str(),
            "inputs [batch, seq], targets [batch, seq] (batch in [2, 65536], seq in [2, 16])");
  EXPECT_TRUE(t.graphs()[0].accepts(tokens(3, 5)));
  EXPECT_FALSE(t.graphs()[0].accepts(tokens(3, 17)));     // beyond block_size
  EXPECT_FALSE(t.graphs()[0].accepts({{3, 5}, {3, 6}}));  // one symbol, two sizes
}

TEST(ShapeTracker, AutoSpecialisesFirstThenMakesTheChangedDimensionDynamic) {
  const ShapeTracker t = feed(D::kAuto, 8, kProbe);
  ASSERT_EQ(t.graphs().size(), 2u);
  ASSERT_EQ(t.recompiles().size(), 1u);
  EXPECT_TRUE(t.graphs()[0].dynamic.empty());
  EXPECT_EQ(t.graphs()[1].str(), "inputs [4, seq], targets [4, seq] (seq in [2, 16])");
  EXPECT_NE(t.recompiles()[0].reason.find("a dynamic graph"), std::string::npos);
  // A new batch size is one more recompile (batch becomes dynamic too).
  ShapeTracker more = t;
  more.record(tokens(2, 16), more.decide(tokens(2, 16)));
  EXPECT_EQ(more.graphs().size(), 3u);
  EXPECT_NE(more.recompiles().back().reason.find("inputs dim 0 changed 4 -> 2 (batch)"),
            std::string::npos);
}

TEST(ShapeTracker, OverTheLimitAShapeRunsEagerAndIsNamed) {
  const ShapeTracker t = feed(D::kStatic, 2, kProbe);
  ASSERT_EQ(t.graphs().size(), 2u);
  ASSERT_EQ(t.recompiles().size(), 2u);
  EXPECT_TRUE(t.recompiles()[0].compiled);
  EXPECT_FALSE(t.recompiles()[1].compiled);
  EXPECT_NE(t.recompiles()[1].reason.find("compile.recompile_limit = 2 reached, so inputs [4, 4], "
                                          "targets [4, 4] runs eager"),
            std::string::npos);
  ASSERT_EQ(t.eager_shapes().size(), 1u);
  EXPECT_EQ(t.decide(tokens(4, 4)).kind, ShapeTracker::Decision::Kind::kEager);
  EXPECT_EQ(t.decide(tokens(4, 16)).kind, ShapeTracker::Decision::Kind::kReuse);
}

TEST(ShapeTracker, ClassificationShapesHaveOnlyABatchDimension) {
  const InputShapes a{{32, 100}, {32}}, b{{16, 100}, {16}};
  ShapeTracker t(D::kAuto, 8, 0);
  t.record(a, t.decide(a));
  t.record(b, t.decide(b));
  ASSERT_EQ(t.graphs().size(), 2u);
  EXPECT_EQ(t.graphs()[1].str(), "inputs [batch, 100], targets [batch] (batch in [2, 65536])");
  EXPECT_TRUE(t.graphs()[1].accepts({{7, 100}, {7}}));
  EXPECT_FALSE(t.graphs()[1].accepts({{7, 99}, {7}}));
}

TEST(CompileOptions, ProbeLengthsParseOrNameTheKey) {
  EXPECT_FALSE(parse_probe_seq_lens("").has_value());
  EXPECT_TRUE(parse_probe_seq_lens("none")->empty());
  EXPECT_EQ(*parse_probe_seq_lens(" 8, 4 "), (std::vector<int64_t>{8, 4}));
  try {
    parse_probe_seq_lens("8,x");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("compile.probe_seq_lens"), std::string::npos);
  }
  EXPECT_THROW(parse_probe_seq_lens("8,0"), UserError);
}

TEST(GraphBreaks, EachBreakIsOneClauseWithItsPlace) {
  EXPECT_EQ(describe_breaks(
                {{"data-dependent branch", "models.py:40 in forward"}, {"print", "x.py:2 in f"}}),
            "graph break at models.py:40 in forward: data-dependent branch; graph break at "
            "x.py:2 in f: print");
}

TEST(CompileReport, TheEvalGraphsAndTheirRecompilesAreListedApartFromTheSteps) {
  // The eval graph is a forward-only graph of its own: its shapes are tracked by a tracker of
  // their own (same dynamic setting and limit), and compile.json lists them under "eval".
  CompileReport report;
  report.graphs.push_back({GraphShape{tokens(4, 16), {}}, false, "not built yet", 2.0, 0.1, "a"});
  const ShapeTracker eval = feed(D::kStatic, 1, kProbe);
  for (const GraphShape& g : eval.graphs()) report.eval_graphs.push_back({g, true, "", 0, 0, "b"});
  report.eval_recompiles = eval.recompiles();
  const nlohmann::json j = report.to_json();
  ASSERT_EQ(j["graphs"].size(), 1u);
  EXPECT_EQ(j["graphs"][0]["graph"], "train");
  EXPECT_TRUE(j["recompiles"].empty());
  ASSERT_EQ(j["eval"]["graphs"].size(), 1u);
  EXPECT_EQ(j["eval"]["graphs"][0]["graph"], "eval");
  ASSERT_EQ(j["eval"]["recompiles"].size(), 2u);  // both probe lengths, over the limit of 1
  EXPECT_EQ(j["eval"]["recompiles"][0]["graph"], "eval");
  EXPECT_EQ(j["eval"]["recompiles"][0]["reason"].get<std::string>().find(
                "inputs dim 1 changed 16 -> 8 (seq)"),
            0u)
      << j["eval"]["recompiles"][0]["reason"];
  EXPECT_FALSE(j["eval"]["recompiles"][0]["compiled"].get<bool>());
}

// ---- the package cache ---------------------------------------------------------------------

Fingerprint fingerprint(const std::string& model) {
  return {{{"model", model}, {"torch", "2.13.0"}, {"shape", {4, 16}}}};
}

TEST(PackageCache, MissThenHitThenRejectsACorruptOrForeignPackage) {
  TempDir dir;
  PackageCache cache(dir / "cache");
  const Fingerprint fp = fingerprint("gpt");
  EXPECT_EQ(fp.key().size(), 16u);
  EXPECT_NE(fp.key(), fingerprint("mlp").key());
  std::string why;
  EXPECT_FALSE(cache.find(fp, &why).has_value());
  EXPECT_EQ(why, "not built yet");

  write_text(dir / "built.pt2", "package bytes");
  const auto published = cache.publish(fp, dir / "built.pt2", {{"parameters", {"w"}}});
  const auto hit = cache.find(fp, &why);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->package, published.package);
  EXPECT_EQ(hit->record["report"]["parameters"][0], "w");

  // Changed bytes: rejected, never loaded.
  write_text(hit->package, "package bytes, changed");
  EXPECT_FALSE(cache.find(fp, &why).has_value());
  EXPECT_NE(why.find("differs from the one recorded"), std::string::npos) << why;

  // A record written for another fingerprint under this key (a copied cache): rejected.
  cache.publish(fp, dir / "built.pt2", {});
  auto record = nlohmann::json::parse(slurp(dir / "cache" / (fp.key() + ".json")));
  record["fingerprint"]["torch"] = "2.12.0";
  write_text(dir / "cache" / (fp.key() + ".json"), record.dump());
  EXPECT_FALSE(cache.find(fp, &why).has_value());
  EXPECT_EQ(why, "built for another fingerprint (torch differs)");

  write_text(dir / "cache" / (fp.key() + ".json"), "{not json");
  EXPECT_FALSE(cache.find(fp, &why).has_value());
  EXPECT_NE(why.find("is not JSON"), std::string::npos);
}

TEST(PackageCache, AnUnwritableDirectoryNamesTheKey) {
  TempDir dir;
  write_text(dir / "file", "x");  // a directory cannot be made under a file, even as root
  try {
    PackageCache cache(dir / "file" / "cache");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("compile.cache_dir"), std::string::npos);
  }
}

TEST(CompilerPython, AMissingPythonOrAnotherTorchIsNamedWithTheFix) {
  TempDir dir;
  try {
    CompilerPython::probe((dir / "no-such-python").string());
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot run Python"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("compile.python"), std::string::npos);
  }
  const auto fake = dir / "python";
  write_text(fake, "#!/bin/sh\necho 'torch 1.0.0 0123abcd'\n");
  std::filesystem::permissions(fake, std::filesystem::perms::owner_all);
  try {
    CompilerPython::probe(fake.string());
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("has torch 1.0.0, but kiln was built against LibTorch"),
              std::string::npos)
        << e.what();
  }
  const auto bare = dir / "bare-python";
  write_text(bare, "#!/bin/sh\necho 'no-torch ModuleNotFoundError no module named torch'\n");
  std::filesystem::permissions(bare, std::filesystem::perms::owner_all);
  try {
    CompilerPython::probe(bare.string());
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("has no torch"), std::string::npos) << e.what();
  }
}

// The probe reads torch's version from its version.py and never imports torch (1.5-2 s at every
// start of a compiled job): a torch whose __init__ raises still answers with its version. Control:
// the same package without version.py is "no torch".
TEST(CompilerPython, ReadsTorchsVersionWithoutImportingIt) {
  // The tests' Python (KILN_TEST_PYTHON, beside its torchrun): the one the interop tests run.
  const std::string real_python =
      (std::filesystem::path(KILN_TORCHRUN).parent_path() / "python").string();
  TempDir dir;
  const auto fake_torch = dir / "site" / "torch";
  std::filesystem::create_directories(fake_torch);
  write_text(fake_torch / "__init__.py", "raise RuntimeError('imported torch')\n");
  const std::string version =
      fmt::format("{}.{}.{}+cpu", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
  write_text(fake_torch / "version.py",
             "from typing import Optional\n__version__ = '" + version +
                 "'\ncuda: Optional[str] = None\ngit_version = 'feedc0de'\n");
  const auto python = dir / "python";  // its own path: the probe caches per Python
  write_text(python, "#!/bin/sh\nPYTHONPATH=" + (dir / "site").string() + " exec " + real_python +
                         " \"$@\"\n");
  std::filesystem::permissions(python, std::filesystem::perms::owner_all);
  const CompilerPython& probed = CompilerPython::probe(python.string());
  EXPECT_EQ(probed.torch_version, version);
  EXPECT_EQ(probed.torch_git, "feedc0de");

  std::filesystem::remove(fake_torch / "version.py");
  const auto control = dir / "python-without-version";
  std::filesystem::copy_file(python, control);
  std::filesystem::permissions(control, std::filesystem::perms::owner_all);
  try {
    CompilerPython::probe(control.string());
    FAIL() << "a torch without version.py passed the probe";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("has no torch"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln
