// The compiled step end to end, through the CLI: AOTInductor packages built by python/kiln_py
// and run from C++. Small models (an MLP, a one-layer GPT) keep each compile short; the tests
// share one cache per build (KILN_TEST_COMPILE_CACHE) except where a cold cache is the point.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "compile/internal.h"
#include "kiln/run.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using nlohmann::json;

std::string mlp_args(const std::filesystem::path& run_dir, const std::string& name) {
  return (source_dir() / "configs/mlp.toml").string() + " --set run.dir=" + run_dir.string() +
         " --set run.name=" + name +
         " --set run.progress=off --set run.threads=1 --set model.hidden_dim=32"
         " --set data.num_samples=512 --set data.val_samples=64 --set data.num_workers=0"
         " --set train.batch_size=16 --set train.eval_every=0 --set train.eval_batches=1";
}

std::string shared_cache() {
  const std::string dir = KILN_TEST_COMPILE_CACHE;
  return " --set compile.cache_dir=" + dir;
}

json read_json(const std::filesystem::path& path) {
  return json::parse(slurp(path));
}

// The last evaluation record of a metrics file ({} when there is none).
json read_last_eval(const std::filesystem::path& path) {
  json last = json::object();
  std::istringstream lines(slurp(path));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    json record = json::parse(line);
    if (record.contains("val_loss")) last = record;
  }
  return last;
}

TEST(CompiledStep, TheRungCompilesColdThenLoadsTheCachedPackage) {
  TempDir dir;
  const std::string args = "compile " + mlp_args(dir.path(), "c") +
                           " --set compile.backend=inductor --set compile.warmup_steps=1"
                           " --set compile.steps=4 --set compile.cache_dir=" +
                           (dir / "cache").string();
  // The verdict follows compile.min_speedup whatever the machine measures: 0 keeps the compiled
  // step, 1e9 stays eager.
  const CommandResult cold = run_kiln(args + " --set compile.min_speedup=0");
  ASSERT_EQ(cold.exit_code, 0) << cold.out << cold.err;
  json first = read_json(dir / "c" / "compile.json");
  EXPECT_EQ(first["cache"], "cold");
  EXPECT_TRUE(first["passed"].get<bool>());
  ASSERT_EQ(first["graphs"], 1);
  EXPECT_FALSE(first["compile"]["graphs"][0]["cache_hit"].get<bool>());
  EXPECT_EQ(first["compile"]["graphs"][0]["cache_note"], "not built yet");
  EXPECT_GT(first["compile"]["graphs"][0]["build_seconds"].get<double>(), 0.0);
  // Compiled and eager agree step by step (fp32, same kernels up to fusion order).
  EXPECT_LE(first["numerics"]["max_relative_loss_difference"].get<double>(), 1e-4);
  EXPECT_LE(first["numerics"]["max_relative_parameter_difference"].get<double>(), 1e-4);
  EXPECT_EQ(first["numerics"]["compiled_losses"].size(), 5u);
  EXPECT_EQ(first["numerics"]["tolerance"], 1e-4);  // fp32's default (compile.tolerance = 0)
  EXPECT_EQ(first["precision"], "fp32");
  // Each side's rate: the model's FLOP per sample at its median step, against the timed matmul.
  ASSERT_GT(first["flops_per_sample"].get<double>(), 0.0) << first;
  ASSERT_GT(first["matmul_peak"]["flops_per_second"].get<double>(), 0.0) << first;
  for (const char* side : {"eager", "compiled"}) {
    const json& s = first[side];
    const double rate =
        first["flops_per_sample"].get<double>() * s["samples_per_second"].get<double>();
    EXPECT_DOUBLE_EQ(s["achieved_flops_per_second"].get<double>(), rate) << side;
    EXPECT_DOUBLE_EQ(s["share_of_matmul_peak"].get<double>(),
                     rate / first["matmul_peak"]["flops_per_second"].get<double>())
        << side;
  }
  EXPECT_NE(cold.out.find("% of the measured matmul)"), std::string::npos) << cold.out;
  EXPECT_EQ(first["verdict"].get<std::string>().rfind("keep the compiled step: ", 0), 0u)
      << first["verdict"];
  EXPECT_NE(cold.out.find("compile — PASSED"), std::string::npos) << cold.out;
  EXPECT_NE(cold.out.find("none (compile.fullgraph = true"), std::string::npos) << cold.out;
  // Evaluation ran through its own forward-only package (built cold too) and agrees with eager.
  ASSERT_EQ(first["eval_graphs"], 1);
  const json eval_graph = first["compile"]["eval"]["graphs"][0];
  EXPECT_EQ(eval_graph["graph"], "eval");
  EXPECT_FALSE(eval_graph["cache_hit"].get<bool>());
  EXPECT_NE(eval_graph["package"], first["compile"]["graphs"][0]["package"]);
  EXPECT_TRUE(first["eval_recompiles"].empty());
  EXPECT_LE(first["eval"]["relative_difference"].get<double>(), 1e-4) << first["eval"];
  EXPECT_LE(first["numerics"]["max_relative_eval_loss_difference"].get<double>(), 1e-4);
  EXPECT_EQ(first["eval"]["accuracy_compiled"], first["eval"]["accuracy_eager"]) << first["eval"];

  // compile.fullgraph is no part of the package: the same one, and the graph-breaks line says
  // which setting the step ran under.
  const CommandResult warm = run_kiln(args +
                                      " --set run.name=w --set compile.min_speedup=1e9"
                                      " --set compile.fullgraph=false");
  ASSERT_EQ(warm.exit_code, 0) << warm.out << warm.err;
  EXPECT_NE(warm.out.find("none found (compile.fullgraph = false"), std::string::npos) << warm.out;
  json second = read_json(dir / "w" / "compile.json");
  EXPECT_EQ(second["verdict"].get<std::string>().rfind("stay eager: the compiled step is", 0), 0u)
      << second["verdict"];
  EXPECT_EQ(second["cache"], "cached");
  EXPECT_TRUE(second["compile"]["graphs"][0]["cache_hit"].get<bool>());
  EXPECT_EQ(second["compile"]["graphs"][0]["package"], first["compile"]["graphs"][0]["package"]);
  EXPECT_TRUE(second["compile"]["eval"]["graphs"][0]["cache_hit"].get<bool>());
  EXPECT_EQ(second["compile"]["eval"]["graphs"][0]["package"], eval_graph["package"]);

  // The cold run built its train and eval packages side by side (compile.jobs = 0: one per core;
  // a one-core machine builds serially). One at a time, into a cache of its own, the rung computes
  // the same losses bit for bit: the concurrent builds compiled the same graphs.
  const CommandResult serial =
      run_kiln(args + " --set run.name=s --set compile.min_speedup=0" +
               " --set compile.jobs=1 --set compile.cache_dir=" + (dir / "serial-cache").string());
  ASSERT_EQ(serial.exit_code, 0) << serial.out << serial.err;
  json third = read_json(dir / "s" / "compile.json");
  EXPECT_EQ(third["cache"], "cold");
  EXPECT_EQ(third["numerics"]["compiled_losses"], first["numerics"]["compiled_losses"]);
  EXPECT_EQ(third["eval"], first["eval"]);

  // A package whose bytes changed is not run here end to end (it cost a third AOTInductor build):
  // PackageCache.MissThenHitThenRejectsACorruptOrForeignPackage (shapes_test.cpp) proves the cache
  // rejects it with "differs from the one recorded", and a rejected package takes the same miss
  // path as the cold run above (cache_note = the cache's reason, then a build).
}

TEST(CompiledStep, TrainingWithAccumulationMatchesEagerTraining) {
  TempDir dir;
  const std::string common = mlp_args(dir.path(), "eager") +
                             " --set train.steps=6 --set train.grad_accum_steps=2" + shared_cache();
  const CommandResult eager = run_kiln("train " + common);
  ASSERT_EQ(eager.exit_code, 0) << eager.err;
  const CommandResult compiled =
      run_kiln("train " + common + " --set run.name=compiled --set compile.backend=inductor");
  ASSERT_EQ(compiled.exit_code, 0) << compiled.out << compiled.err;
  EXPECT_NE(compiled.out.find("compiled step: inductor, 1 graph(s), 0 recompile(s)"),
            std::string::npos)
      << compiled.out;
  // The final evaluation ran through the eval package: the same validation loss and accuracy.
  EXPECT_NE(compiled.out.find("eval: 1 graph(s), 0 recompile(s)"), std::string::npos)
      << compiled.out;
  const json eager_eval = read_last_eval(dir / "eager" / "metrics.jsonl");
  const json compiled_eval = read_last_eval(dir / "compiled" / "metrics.jsonl");
  ASSERT_TRUE(eager_eval.contains("val_loss")) << eager_eval;
  EXPECT_NEAR(compiled_eval["val_loss"].get<double>(), eager_eval["val_loss"].get<double>(),
              1e-5 * eager_eval["val_loss"].get<double>());
  EXPECT_EQ(compiled_eval["val_accuracy"], eager_eval["val_accuracy"]);
  const auto a = read_step_losses(dir / "eager" / "metrics.jsonl");
  const auto b = read_step_losses(dir / "compiled" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (const auto& [step, loss] : a) {
    EXPECT_NEAR(b.at(step), loss, 1e-5 * std::abs(loss)) << "step " << step;
  }
}

// The largest relative difference of two runs' per-step losses (both must have `steps`).
double worst_loss_difference(const std::map<int64_t, double>& a, const std::map<int64_t, double>& b,
                             size_t steps) {
  EXPECT_EQ(a.size(), steps);
  EXPECT_EQ(b.size(), steps);
  double worst = 0;
  for (const auto& [step, loss] : a) {
    const auto it = b.find(step);
    if (it == b.end()) return INFINITY;
    worst = std::max(worst, std::abs(it->second - loss) / std::abs(loss));
  }
  return worst;
}

// A user's own PyTorch model, imported as a package (the example's causal convolutional LM): its
// Python twin is the package's own graph (kiln_py/exported_twin.py), compiled as one whole step;
// the compiled training follows the eager graph runner's.
TEST(CompiledStep, AnExportedPackageCompilesAsOneGraphAndTrainsAsEager) {
  TempDir dir;
  const std::filesystem::path package = dir / "convlm";
  const CommandResult imported = run_kiln(
      "model import --module " + (source_dir() / "examples/python_model/model.py").string() +
      ":build --options '{\"width\": 16}' --max-seq 16 --out " + package.string());
  ASSERT_EQ(imported.exit_code, 0) << imported.out << imported.err;
  const std::string common =
      (source_dir() / "configs/gpt-tiny.toml").string() + " --set run.dir=" + dir.path().string() +
      " --set run.progress=off --set run.threads=1 --set model.name=exported --set model.package=" +
      package.string() +
      " --set data.seq_len=16 --set data.num_workers=0 --set train.batch_size=4"
      " --set train.steps=5 --set train.eval_every=0 --set train.eval_batches=1"
      " --set run.name=eager" +
      shared_cache();
  const CommandResult eager = run_kiln("train " + common);
  ASSERT_EQ(eager.exit_code, 0) << eager.out << eager.err;
  const CommandResult compiled =
      run_kiln("train " + common + " --set run.name=compiled --set compile.backend=inductor");
  ASSERT_EQ(compiled.exit_code, 0) << compiled.out << compiled.err;
  EXPECT_NE(compiled.out.find("compiled step: inductor, 1 graph(s), 0 recompile(s)"),
            std::string::npos)
      << compiled.out;
  EXPECT_LE(worst_loss_difference(read_step_losses(dir / "eager" / "metrics.jsonl"),
                                  read_step_losses(dir / "compiled" / "metrics.jsonl"), 5),
            1e-5);
  // Per-unit compilation of a package is not built: refused by the config rule, before anything
  // runs (activation checkpointing asks it under compile.granularity = "auto").
  const CommandResult per_unit = run_kiln("config validate " + common +
                                          " --set compile.backend=inductor"
                                          " --set train.activation_checkpointing=block");
  EXPECT_EQ(per_unit.exit_code, 2) << per_unit.out;
  EXPECT_NE(per_unit.err.find("an exported package compiles as one whole-step graph only"),
            std::string::npos)
      << per_unit.err;
}

// Mixed precision inside the compiled graph: the package is exported under torch.autocast (the
// policy of kiln's eager step), so compiled and eager of the same precision agree far more
// closely than either agrees with fp32. Measured on this mlp: compiled vs eager 2.2e-7 relative
// (bf16-mixed, 6 steps, accumulation 2) and 1.1e-7 (fp16-mixed, 4 steps): the same low-precision
// matmuls, fusion order only; bf16 vs fp32 1.3e-4, fp16 vs fp32 2.0e-5.
constexpr double kMixedTolerance = 2e-6;
constexpr double kPrecisionControl = 5 * kMixedTolerance;  // fp32 differs by more than this

TEST(CompiledStep, BfloatMixedTrainsInsideTheGraphUnderDdpWithAccumulation) {
  TempDir dir;
  std::map<std::string, std::map<int64_t, double>> losses;
  for (const auto& [name, set] : std::vector<std::pair<std::string, std::string>>{
           {"eager", "--set train.precision=bf16-mixed"},
           {"compiled", "--set train.precision=bf16-mixed --set compile.backend=inductor"},
           {"fp32", ""}}) {
    const CommandResult r =
        run_shell(std::string(KILN_TORCHRUN) + " --standalone --nproc-per-node=2 --no-python " +
                  KILN_CLI + " train " + mlp_args(dir.path(), name) +
                  " --set train.steps=6 --set train.grad_accum_steps=2 " + set + shared_cache());
    ASSERT_EQ(r.exit_code, 0) << name << r.out << r.err;
    losses[name] = read_step_losses(dir / name / "metrics.jsonl");
  }
  EXPECT_LE(worst_loss_difference(losses["eager"], losses["compiled"], 6), kMixedTolerance);
  // The control: a package without the autocast policy would match fp32, which differs.
  EXPECT_GT(worst_loss_difference(losses["fp32"], losses["compiled"], 6), kPrecisionControl);
}

TEST(CompiledStep, HalfMixedDifferentiatesTheScaledLossInsideTheGraph) {
  // fp16-mixed: the graph takes the loss scaler's scale (2^16 at first) and returns the
  // gradients of loss x scale; kiln unscales them, checks for overflow and updates the scale.
  TempDir dir;
  std::map<std::string, std::map<int64_t, double>> losses;
  for (const auto& [name, set] : std::vector<std::pair<std::string, std::string>>{
           {"eager", "--set train.precision=fp16-mixed"},
           {"compiled", "--set train.precision=fp16-mixed --set compile.backend=inductor"},
           {"fp32", ""}}) {
    const CommandResult r = run_kiln("train " + mlp_args(dir.path(), name) +
                                     " --set train.steps=4 " + set + shared_cache());
    ASSERT_EQ(r.exit_code, 0) << name << r.out << r.err;
    losses[name] = read_step_losses(dir / name / "metrics.jsonl");
  }
  EXPECT_LE(worst_loss_difference(losses["eager"], losses["compiled"], 4), kMixedTolerance);
  EXPECT_GT(worst_loss_difference(losses["fp32"], losses["compiled"], 4), kPrecisionControl);
}

TEST(CompiledStep, EagerHalfMixedWithCheckpointingTrainsUnderFsdpWithAccumulation) {
  // A cell of the production-step matrix with no compiled step: eager x fp16-mixed x
  // activation checkpointing x FSDP x accumulation 2, two ranks, three steps.
  TempDir dir;
  const CommandResult r =
      run_shell(std::string(KILN_TORCHRUN) + " --standalone --nproc-per-node=2 --no-python " +
                KILN_CLI + " train " + (source_dir() / "configs/gpt-tiny.toml").string() +
                " --set run.dir=" + dir.path().string() +
                " --set run.name=f --set run.progress=off --set run.threads=1 --set model.n_layer=2"
                " --set model.n_embd=32 --set model.n_head=2 --set model.block_size=16"
                " --set data.seq_len=16 --set train.batch_size=2 --set data.num_workers=0"
                " --set train.eval_batches=1 --set train.steps=3 --set train.grad_accum_steps=2"
                " --set train.precision=fp16-mixed --set train.activation_checkpointing=block"
                " --set dist.strategy=fsdp");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto losses = read_step_losses(dir / "f" / "metrics.jsonl");
  ASSERT_EQ(losses.size(), 3u);
  for (const auto& [step, loss] : losses) EXPECT_TRUE(std::isfinite(loss)) << step;
  EXPECT_NE(r.err.find("strategy fsdp"), std::string::npos) << r.err;
}

TEST(CompiledStep, AutoStrategyResolvingToFsdpIsRefusedBeforeAnythingIsWritten) {
  // dist.strategy = "auto" decides by the model's memory, so no rule can: with a device of 1 KB
  // it picks fsdp, and a compiled step is refused at the start, with one line, writing nothing.
  TempDir dir;
  const CommandResult r = run_shell(
      std::string(KILN_TORCHRUN) + " --standalone --nproc-per-node=2 --no-python " + KILN_CLI +
      " train " + mlp_args(dir.path(), "auto") +
      " --set train.steps=2 --set compile.backend=inductor --set dist.device_memory_bytes=1000" +
      shared_cache());
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("dist.strategy = \"auto\": fsdp"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("FSDP gathers each unit's parameters around its forward"), std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "auto")) << r.err;
}

TEST(CompiledStep, UnderDataParallelTheGradientsAreReducedAfterThePackageReturns) {
  // Autograd's gradient hooks do not fire for a compiled micro-step: DDP reduces every bucket in
  // on_gradients_ready instead. Two ranks under torchrun, compiled against eager.
  TempDir dir;
  std::map<int64_t, double> losses[2];
  int side = 0;
  for (const char* backend : {"eager", "inductor"}) {
    const CommandResult r =
        run_shell(std::string(KILN_TORCHRUN) + " --standalone --nproc-per-node=2 --no-python " +
                  KILN_CLI + " train " + mlp_args(dir.path(), backend) +
                  " --set train.steps=5 --set compile.backend=" + backend + shared_cache());
    ASSERT_EQ(r.exit_code, 0) << backend << r.out << r.err;
    losses[side++] = read_step_losses(dir / backend / "metrics.jsonl");
  }
  ASSERT_EQ(losses[0].size(), 5u);
  ASSERT_EQ(losses[1].size(), 5u);
  for (const auto& [step, loss] : losses[0]) {
    EXPECT_NEAR(losses[1].at(step), loss, 1e-5 * std::abs(loss)) << "step " << step;
  }
}

TEST(CompiledStep, TheRungUnderDdpReportsTheOverlapLost) {
  // Two ranks on Gloo, the packages of the tests above (shared cache): both sides are DDP; the
  // eager side starts its bucket all-reduces from autograd's hooks during backward, the compiled
  // side only after the package returned its gradients.
  TempDir dir;
  const CommandResult r = run_shell(
      std::string(KILN_TORCHRUN) + " --standalone --nproc-per-node=2 --no-python " + KILN_CLI +
      " compile " + mlp_args(dir.path(), "d") +
      " --set compile.backend=inductor --set compile.warmup_steps=1 --set compile.steps=3" +
      shared_cache());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  json j = read_json(dir / "d" / "compile.json");
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_TRUE(j["passed"].get<bool>()) << j["verdict"];
  ASSERT_TRUE(j.contains("ddp")) << j;
  const json& ddp = j["ddp"];
  EXPECT_EQ(ddp["backend"], "gloo");
  for (const char* side : {"eager", "compiled"}) {
    EXPECT_GT(ddp[side]["comm_busy_seconds_per_step"].get<double>(), 0.0) << side;
    EXPECT_GE(ddp[side]["comm_exposed_seconds_per_step"].get<double>(), 0.0) << side;
    const double share = ddp[side]["comm_overlapped_share"].get<double>();
    EXPECT_TRUE(share >= 0.0 && share <= 1.0) << side << share;
  }
  // The mlp's gradients fit the first bucket: eager starts exactly that one all-reduce from
  // autograd's hooks during backward, the compiled step none (its buckets start after it).
  EXPECT_EQ(ddp["eager"]["collectives_started_in_backward_per_step"].get<double>(), 1.0) << ddp;
  EXPECT_EQ(ddp["compiled"]["collectives_started_in_backward_per_step"].get<double>(), 0.0) << ddp;
  EXPECT_NE(r.out.find("DDP overlap"), std::string::npos) << r.out;
  EXPECT_LE(j["eval"]["relative_difference"].get<double>(), 1e-4) << j["eval"];
}

// A one-layer GPT with a dynamic sequence dimension (one package shared by the two tests below).
std::string gpt_args(const std::filesystem::path& run_dir, const std::string& name) {
  return (source_dir() / "configs/gpt-tiny.toml").string() + " --set run.dir=" + run_dir.string() +
         " --set run.name=" + name +
         " --set run.progress=off --set run.threads=2 --set model.n_layer=1"
         " --set model.n_embd=32 --set model.n_head=2 --set model.block_size=16"
         " --set data.seq_len=16 --set train.batch_size=4 --set data.num_workers=0"
         " --set train.eval_batches=1 --set compile.backend=inductor --set "
         "compile.dynamic=dynamic" +
         shared_cache();
}

TEST(CompiledStep, ACompiledRunRepeatsBitwiseOnCpu) {
  // run.deterministic compiles the package in deterministic mode: the embedding backward's
  // scatter-add no longer uses parallel atomics (2 threads here, so their order could vary:
  // without deterministic mode, this job's losses differed at step 14 of 20 between two runs).
  TempDir dir;
  std::map<int64_t, double> losses[2];
  for (int k = 0; k < 2; ++k) {
    const std::string name = fmt::format("r{}", k);
    const CommandResult r = run_kiln("train " + gpt_args(dir.path(), name) +
                                     " --set train.steps=20 --set train.batch_size=16"
                                     " --set train.eval_every=0");
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    losses[k] = read_step_losses(dir / name / "metrics.jsonl");
  }
  ASSERT_EQ(losses[0].size(), 20u);
  EXPECT_EQ(losses[0], losses[1]);
}

// The pilot proves the step the job will run: with compile.backend set it trains, evaluates and
// saves through the compiled step, and the restore child (`kiln train --resume`, compiled too)
// continues bitwise. (Before, the pilot ran eager and its compiled child differed in every tensor.)
TEST(CompiledStep, ThePilotRunsTheCompiledStepAndItsRestoreIsBitwise) {
  TempDir dir;
  const CommandResult r = run_kiln("pilot " + mlp_args(dir.path(), "p") +
                                   " --set compile.backend=inductor" + shared_cache());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("compiled (inductor)"), std::string::npos) << r.out;
  const json pilot = read_json(dir / "p" / "pilot.json");
  EXPECT_EQ(pilot["compile_backend"], "inductor");
  EXPECT_TRUE(pilot["restore"]["passed"].get<bool>()) << pilot["restore"];
  EXPECT_TRUE(pilot["restore"]["loss_bitwise_equal"].get<bool>()) << pilot["restore"];
  EXPECT_TRUE(pilot["restore"]["differing_tensors"].empty()) << pilot["restore"];
  EXPECT_NE(slurp(dir / "p" / "pilot" / "restore.log").find("compiled step: inductor"),
            std::string::npos);
}

TEST(CompiledStep, ADataDependentBranchIsAGraphBreakNamedWithItsPlace) {
  TempDir dir;
  const std::string args = "compile " + mlp_args(dir.path(), "full") +
                           " --set model.data_dependent_branch=true"
                           " --set compile.backend=inductor" +
                           shared_cache();
  const CommandResult full = run_kiln(args);
  EXPECT_EQ(full.exit_code, 3) << full.out << full.err;
  EXPECT_NE(full.err.find("compile.fullgraph = true and the step has 1 graph break(s): graph "
                          "break at models.py:"),
            std::string::npos)
      << full.err;
  json j = read_json(dir / "full" / "compile.json");
  ASSERT_EQ(j["compile"]["graph_breaks"].size(), 1u);
  EXPECT_NE(j["compile"]["graph_breaks"][0]["where"].get<std::string>().find("models.py:"),
            std::string::npos);

  const CommandResult eager =
      run_kiln(args + " --set run.name=fallback --set compile.fullgraph=false");
  ASSERT_EQ(eager.exit_code, 0) << eager.out << eager.err;
  json f = read_json(dir / "fallback" / "compile.json");
  EXPECT_TRUE(f["compile"]["fallback_to_eager"].get<bool>());
  EXPECT_EQ(f["verdict"].get<std::string>().rfind("stay eager: the step has 1 graph break(s)", 0),
            0u)
      << f["verdict"];
}

TEST(CompiledStep, BadSetupIsOneLineExitTwoAndWritesNothing) {
  TempDir dir;
  write_text(dir / "file", "x");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--set compile.backend=inductor --set compile.python=" + (dir / "nope").string(),
       "cannot run Python"},
      {"--set compile.backend=cudagraphs", "needs a CUDA device (run.device = \"cuda\")"},
      {"--set compile.backend=inductor --set compile.cache_dir=" + (dir / "file" / "c").string(),
       "compile.cache_dir"},
  };
  for (const auto& [set, message] : cases) {
    for (const char* command : {"train ", "compile "}) {
      const CommandResult r = run_kiln(command + mlp_args(dir.path(), "bad") + " " + set);
      EXPECT_EQ(r.exit_code, 2) << command << set << r.err;
      EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
      EXPECT_FALSE(std::filesystem::exists(dir / "bad")) << command << set;
    }
  }
}

// Last in the file (CTest runs the tests in this order under -j 2): it shares its package with
// ACompiledRunRepeatsBitwiseOnCpu, whose cold build it waited on when it ran right beside it.
TEST(CompiledStep, ADynamicGraphServesTheProbesShorterSequences) {
  TempDir dir;
  const CommandResult r = run_kiln("compile " + gpt_args(dir.path(), "g") +
                                   " --set compile.warmup_steps=1 --set compile.steps=3"
                                   " --set compile.probe_seq_lens=8,4");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  json j = read_json(dir / "g" / "compile.json");
  EXPECT_EQ(j["dynamic"], "dynamic");
  EXPECT_EQ(j["graphs"], 1);
  EXPECT_TRUE(j["recompiles"].empty()) << j["recompiles"];
  ASSERT_EQ(j["probe"].size(), 2u);
  for (const auto& p : j["probe"]) {
    EXPECT_FALSE(p["new_graph"].get<bool>()) << p;
    EXPECT_NEAR(p["loss_compiled"].get<double>(), p["loss_eager"].get<double>(),
                1e-4 * p["loss_eager"].get<double>());
    // The eval graph (its own package, dynamic too) serves the shorter batch without recompiling.
    EXPECT_FALSE(p["eval"]["recompiled"].get<bool>()) << p;
    EXPECT_FALSE(p["eval"]["new_graph"].get<bool>()) << p;
    EXPECT_NEAR(p["eval"]["loss_compiled"].get<double>(), p["eval"]["loss_eager"].get<double>(),
                1e-4 * p["eval"]["loss_eager"].get<double>());
  }
  EXPECT_EQ(j["eval_graphs"], 1);
  EXPECT_TRUE(j["eval_recompiles"].empty()) << j["eval_recompiles"];
  EXPECT_NE(j["compile"]["eval"]["graphs"][0]["shape"].get<std::string>().find("seq in [2, 16]"),
            std::string::npos);
  EXPECT_LE(j["eval"]["relative_difference"].get<double>(), 1e-4) << j["eval"];
  EXPECT_NE(j["compile"]["graphs"][0]["shape"].get<std::string>().find("seq in [2, 16]"),
            std::string::npos);
  EXPECT_TRUE(j["passed"].get<bool>()) << j["verdict"];
}

}  // namespace
}  // namespace kiln::testing
