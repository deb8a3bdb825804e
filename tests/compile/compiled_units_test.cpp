// Per-unit compilation (compile.granularity = "unit"): each transformer block runs through its
// AOTInductor forward and backward packages inside the unit wrappers. A two-layer GPT (both
// blocks share one package pair) against the same model eager, in process (the gradients of
// every parameter) and through `kiln train` (per-step losses), with activation checkpointing
// on. The packages live in the build's shared test cache (KILN_TEST_COMPILE_CACHE): the
// in-process and CLI tests use the same shapes, so one fp32 and one bf16-mixed pair serve all.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kiln/compile.h"
#include "kiln/data.h"
#include "kiln/models.h"
#include "kiln/run.h"
#include "kiln/train.h"
#include "support/compose.h"
#include "support/helpers.h"
#include "train/activation_checkpointing.h"
#include "train/precision.h"

namespace kiln::testing {
namespace {

// gpt_config's shape (2 layers, n_embd 64, batch 8 x seq 32): the CLI tests' --set below match.
const std::vector<std::string> kUnitKeys = {
    "compile.backend=inductor", "compile.granularity=unit",
    std::string("compile.cache_dir=") + KILN_TEST_COMPILE_CACHE,
    "train.activation_checkpointing=block"};

struct Gradients {
  double loss = 0;
  std::map<std::string, torch::Tensor> grads;
};

// One forward (under `precision`'s autocast) and backward of `model` on a fixed batch.
Gradients forward_backward(Model& model, const std::string& precision) {
  torch::manual_seed(7);
  const torch::Tensor inputs = torch::randint(0, 256, {8, 32}, torch::kLong);
  const torch::Tensor targets = torch::randint(0, 256, {8, 32}, torch::kLong);
  torch::Tensor loss;
  {
    std::unique_ptr<AutocastGuard> autocast;
    if (precision == "bf16-mixed") {
      autocast = std::make_unique<AutocastGuard>(
          AutocastState{c10::DeviceType::CPU, true, at::kBFloat16, true});
    }
    loss = model.loss(model.forward(inputs), targets);
  }
  loss.backward();
  Gradients out;
  out.loss = loss.item<double>();
  for (const auto& item : model.named_parameters()) out.grads[item.key()] = item.value().grad();
  return out;
}

// The largest |a - b| of a gradient over the largest |b|, across parameters.
double worst_gradient_difference(const Gradients& a, const Gradients& b) {
  double worst = 0;
  for (const auto& [name, grad] : b.grads) {
    EXPECT_TRUE(a.grads.at(name).defined()) << name;
    if (!a.grads.at(name).defined()) return INFINITY;
    const double scale = grad.abs().max().item<double>();
    worst = std::max(worst, (a.grads.at(name) - grad).abs().max().item<double>() / scale);
  }
  return worst;
}

struct UnitRun {
  Gradients eager, compiled;
  CompileReport report;
};

UnitRun run_both(const std::string& precision) {
  TempDir dir;
  std::vector<std::string> keys = kUnitKeys;
  keys.push_back("train.precision=" + precision);
  const Config config = gpt_config(dir.path(), keys);
  apply_runtime_settings(config);  // run.deterministic, as `kiln train` (part of the cache key)
  UnitRun out;
  for (bool compiled : {false, true}) {
    std::shared_ptr<Model> model = make_model(config);  // run.seed: the same weights
    model->add_unit_wrapper(make_activation_checkpointing(*model, model->units()));
    std::shared_ptr<CompiledStep> step;
    if (compiled) {
      step = std::make_shared<CompiledStep>(CompileOptions::from_config(config),
                                            TrainOptions::from_config(config).precision, *model,
                                            torch::Device(torch::kCPU));
      EXPECT_TRUE(step->per_unit());
    }
    (compiled ? out.compiled : out.eager) = forward_backward(*model, precision);
    if (step) out.report = step->report();
  }
  return out;
}

TEST(CompiledUnits, EachBlocksForwardAndBackwardMatchEagerUnderCheckpointing) {
  const UnitRun r = run_both("fp32");
  // fp32: the same math, fused differently. Measured: loss 0, gradients ~1e-6 of their scale.
  EXPECT_NEAR(r.compiled.loss, r.eager.loss, 1e-6 * r.eager.loss);
  EXPECT_LE(worst_gradient_difference(r.compiled, r.eager), 1e-4);
  // Both blocks ran compiled, through one package pair (equal shapes), and activation
  // checkpointing recomputed each through the compiled forward: 2 blocks x (forward without
  // grad + recomputation in backward).
  ASSERT_EQ(r.report.unit_graphs.size(), 2u);
  EXPECT_EQ(r.report.granularity, "unit");
  EXPECT_EQ(r.report.unit_graphs[0].unit, "transformer.h.0");
  EXPECT_EQ(r.report.unit_graphs[0].input, "float32 [8, 32, 64]");
  EXPECT_FALSE(r.report.unit_graphs[0].shared);
  EXPECT_TRUE(r.report.unit_graphs[1].shared);
  EXPECT_EQ(r.report.unit_graphs[1].forward_package, r.report.unit_graphs[0].forward_package);
  EXPECT_NE(r.report.unit_graphs[0].forward_package, r.report.unit_graphs[0].backward_package);
  EXPECT_EQ(r.report.compiled_unit_forwards, 4);
  EXPECT_EQ(r.report.eager_unit_calls, 0);
  const nlohmann::json json = r.report.to_json();
  ASSERT_EQ(json["units"].size(), 2u);
  EXPECT_EQ(json["units"][1]["graphs"][1]["graph"], "unit_backward");
}

TEST(CompiledUnits, BfloatMixedUnitGraphsMatchEagerBfloatMixed) {
  const UnitRun r = run_both("bf16-mixed");
  const double tolerance = 2e-3;  // relative, on the loss; gradients below
  EXPECT_NEAR(r.compiled.loss, r.eager.loss, tolerance * r.eager.loss);
  EXPECT_LE(worst_gradient_difference(r.compiled, r.eager), 2e-2);  // measured 5e-3
  // No precision control here: on this random batch compiled bf16 is about as far from eager
  // bf16 as from fp32 (loss 7.2e-6 vs 8.6e-6, worst gradient 5e-3 vs 6.6e-3); the CLI test below
  // has one on real text.
  EXPECT_EQ(r.report.compiled_unit_forwards, 4);
  EXPECT_EQ(r.report.precision, "bf16-mixed");
}

// compile.root (the default): the root compiles as its own graphs, two pieces around the units
// ("root.before_units": the embeddings; "root.after_units": final norm, tied head and loss), run
// by the compiled step's executor with the checkpointed, compiled blocks between them. Trained
// side by side with the same model eager (in-process Trainers, gpt_config's shape: the packages
// are the CLI test's below, through the shared cache).
TEST(CompiledUnits, TheRootCompilesAsTwoPiecesAroundTheUnitsAndTrainsAsEager) {
  TempDir dir;
  std::vector<std::string> keys = kUnitKeys;
  keys.push_back("data.num_workers=0");
  const Config config = gpt_config(dir.path(), keys);
  apply_runtime_settings(config);  // run.deterministic, as `kiln train` (part of the cache key)
  Trainer eager(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  install_configured_checkpointing(eager);
  Trainer compiled(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  install_configured_checkpointing(compiled);
  const std::shared_ptr<CompiledStep> step = attach_compiled_step(compiled, config);
  ASSERT_TRUE(step && step->per_unit());
  auto eager_log = std::make_shared<StepLog>(), compiled_log = std::make_shared<StepLog>();
  eager.add_hook(eager_log);
  compiled.add_hook(compiled_log);
  constexpr int kSteps = 3;
  for (int k = 0; k < kSteps; ++k) {
    eager.train_step(/*sync=*/true);
    compiled.train_step(/*sync=*/true);
  }
  ASSERT_EQ(compiled_log->steps.size(), static_cast<size_t>(kSteps));
  // fp32, fused differently: measured 9e-8 relative on the losses (kiln train, 4 steps) and the
  // same float32 first-step gradient norm (before any update). A gradient lost on the way is
  // off by far more (the head's input detached: step 2's loss 5.4% off, the norm 0.72 for 2.91).
  for (int k = 0; k < kSteps; ++k) {
    const double want = eager_log->steps[k].loss;
    EXPECT_NEAR(compiled_log->steps[k].loss, want, 1e-5 * want) << "step " << k + 1;
  }
  const double norm = eager_log->steps[0].grad_norm;
  EXPECT_NEAR(compiled_log->steps[0].grad_norm, norm, 1e-5 * norm);
  // compile.json's listing: both root pieces, each a forward and a backward package of its own,
  // beside the two blocks (one shared pair), which still ran compiled and were recomputed.
  const CompileReport& report = step->report();
  const nlohmann::json json = report.to_json();
  ASSERT_EQ(json["root"].size(), 2u) << json.dump();
  EXPECT_EQ(json["root"][0]["piece"], "root.before_units");
  EXPECT_EQ(json["root"][0]["input"], "int64 [8, 32]");
  EXPECT_EQ(json["root"][1]["piece"], "root.after_units");
  EXPECT_EQ(json["root"][1]["input"], "float32 [8, 32, 64]");
  for (const auto& piece : json["root"]) {
    EXPECT_FALSE(piece["eager"].get<bool>());
    EXPECT_EQ(piece["graphs"][0]["graph"], "root_forward");
    EXPECT_EQ(piece["graphs"][1]["graph"], "root_backward");
    EXPECT_NE(piece["graphs"][0]["package"], piece["graphs"][1]["package"]);
    EXPECT_NE(piece["graphs"][0]["package"], json["units"][0]["graphs"][0]["package"]);
  }
  EXPECT_NE(json["root"][0]["graphs"][0]["package"], json["root"][1]["graphs"][0]["package"]);
  ASSERT_EQ(json["units"].size(), 2u);
  EXPECT_EQ(json["units"][0]["unit"], "transformer.h.0");
  EXPECT_EQ(report.compiled_unit_forwards, kSteps * 2 * 2);  // 2 blocks x (forward + recompute)
  EXPECT_EQ(report.eager_unit_calls, 0);
}

// Per-step losses of `kiln train` on gpt_config's shape (text data), `steps` steps.
// `launcher`: the kiln CLI, or torchrun starting it.
std::map<int64_t, double> train_losses(const TempDir& dir, const std::string& name,
                                       const std::string& extra, int steps, std::string* out,
                                       const std::string& launcher = KILN_CLI) {
  const CommandResult r = run_shell(
      launcher + " train " + (source_dir() / "configs/gpt-tiny.toml").string() +
      " --set run.dir=" + dir.path().string() + " --set run.name=" + name +
      " --set run.progress=off --set run.threads=1 --set model.n_layer=2 --set model.n_embd=64"
      " --set model.n_head=4 --set data.seq_len=32 --set train.batch_size=8"
      " --set data.num_workers=0 --set train.eval_every=0 --set train.eval_batches=1"
      " --set train.steps=" +
      std::to_string(steps) + " --set train.activation_checkpointing=block " + extra);
  EXPECT_EQ(r.exit_code, 0) << name << r.out << r.err;
  if (out) *out = r.out + r.err;
  return read_step_losses(dir / name / "metrics.jsonl");
}

// The first step's gradient norm (before clipping and any update) of a run's metrics.
double first_grad_norm(const std::filesystem::path& metrics) {
  std::istringstream lines(slurp(metrics));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    const nlohmann::json record = nlohmann::json::parse(line);
    if (record.value("step", 0) == 1 && record.contains("grad_norm"))
      return record["grad_norm"].get<double>();
  }
  ADD_FAILURE() << "no grad_norm at step 1 in " << metrics;
  return NAN;
}

double worst_relative(const std::map<int64_t, double>& a, const std::map<int64_t, double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& [step, loss] : a) {
    if (!b.count(step)) return INFINITY;
    worst = std::max(worst, std::abs(b.at(step) - loss) / std::abs(loss));
  }
  return worst;
}

TEST(CompiledUnits, FsdpAtTwoRanksWithCheckpointingAndBf16MatchesEager) {
  // The production step: bf16-mixed, activation checkpointing per block, FSDP at 2 ranks, each
  // block compiled; against the same in eager. FSDP's param_dtype makes the gathered parameters
  // (and so the blocks' inputs) bfloat16: a pair of its own.
  TempDir dir;
  // The root eager (compile.root = false): its bf16 pieces would be two more cold pairs.
  const std::string fsdp =
      " --set dist.strategy=fsdp --set train.precision=bf16-mixed --set compile.root=false";
  std::map<std::string, std::map<int64_t, double>> losses;
  std::string log;
  for (const std::string name : {"eager", "unit"}) {
    const std::string compiled =
        name == "unit" ? std::string(" --set compile.backend=inductor --set compile.cache_dir=") +
                             KILN_TEST_COMPILE_CACHE
                       : "";
    losses[name] = train_losses(
        dir, name, fsdp + compiled, 3, &log,
        std::string(KILN_TORCHRUN) + " --standalone --nproc-per-node=2 --no-python " + KILN_CLI);
  }
  ASSERT_EQ(losses["eager"].size(), 3u);
  EXPECT_LE(worst_relative(losses["eager"], losses["unit"]), 2e-3);
  // The first step's gradient norm, before updates: measured 2.6e-6 relative. Losses over three
  // steps alone missed a real bug (two saved tensors swapped: gradients 59% off).
  const double eager_norm = first_grad_norm(dir / "eager" / "metrics.jsonl");
  EXPECT_NEAR(first_grad_norm(dir / "unit" / "metrics.jsonl"), eager_norm, 1e-4 * eager_norm);
  EXPECT_NE(log.find("compile: unit transformer.h.0 for input bfloat16 [8, 32, 64]"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("strategy fsdp"), std::string::npos) << log;
}

// Defined (and so run by CTest, in this order under -j 2) after the FSDP test: the root pieces
// it wants are the in-process test's above, built by then; run beside that test, it waited on
// their build lock for ~70 s.
TEST(CompiledUnits, TrainingWithCheckpointingMatchesEagerInFp32AndBf16) {
  TempDir dir;
  const std::string unit = std::string("--set compile.backend=inductor --set compile.cache_dir=") +
                           KILN_TEST_COMPILE_CACHE;  // granularity auto: unit (checkpointing)
  std::string log;
  const auto eager = train_losses(dir, "eager", "", 4, nullptr);
  const auto compiled = train_losses(dir, "unit", unit, 4, &log);
  ASSERT_EQ(eager.size(), 4u);
  EXPECT_LE(worst_relative(eager, compiled), 1e-5);
  EXPECT_NE(log.find("compile: unit transformer.h.0 for input float32 [8, 32, 64]"),
            std::string::npos)
      << log;
  // compile.root (the default): the root's pieces compiled too (the in-process test's packages).
  EXPECT_NE(log.find("compile: root piece root.after_units for input float32 [8, 32, 64]"),
            std::string::npos)
      << log;
  // bf16-mixed with the root eager (compile.root = false): its pieces would be two more cold
  // package pairs for the test suite; the blocks are what this run checks.
  const auto eager_bf16 =
      train_losses(dir, "eager_bf16", "--set train.precision=bf16-mixed", 4, nullptr);
  const auto compiled_bf16 =
      train_losses(dir, "unit_bf16",
                   unit + " --set train.precision=bf16-mixed --set compile.root=false", 4, &log);
  EXPECT_EQ(log.find("root piece"), std::string::npos) << log;
  // Measured: 1.1e-4 over 4 steps (the first step's loss 7e-7).
  EXPECT_LE(worst_relative(eager_bf16, compiled_bf16), 2e-3);
  // The control, on the first step's loss (the forward only, before updates spread rounding
  // differences): the compiled blocks round as bf16-mixed does, several times closer to eager
  // bf16-mixed than to fp32 (measured 3.8e-6 vs 5.5e-5 absolute).
  ASSERT_TRUE(compiled_bf16.count(1) && eager_bf16.count(1) && eager.count(1));
  EXPECT_LT(3 * std::abs(compiled_bf16.at(1) - eager_bf16.at(1)),
            std::abs(compiled_bf16.at(1) - eager.at(1)));
}

// Cold, with the root compiled and compile.jobs = 2: one eager forward without gradients finds
// the three pieces' inputs and their pairs build side by side before the first step, which then
// loads them. That forward changes nothing: the run trains bit for bit as a second run on the
// packages it left. Control: the warm run builds nothing and says nothing of building.
TEST(CompiledUnits, AColdFirstStepBuildsThePiecesSideBySideAndTrainsAsWarm) {
  TempDir dir;
  const std::string unit =
      "--set compile.backend=inductor --set compile.jobs=2 --set compile.cache_dir=" +
      (dir / "cache").string();
  std::string cold_log, warm_log;
  const auto cold = train_losses(dir, "cold", unit, 2, &cold_log);
  const auto warm = train_losses(dir, "warm", unit, 2, &warm_log);
  ASSERT_EQ(cold.size(), 2u);
  EXPECT_EQ(cold, warm);  // bitwise
  EXPECT_NE(cold_log.find("compile: building 3 pieces' packages side by side, 2 at a time"),
            std::string::npos)
      << cold_log;
  for (const std::string piece :
       {"root piece root.before_units for input int64 [8, 32]: built in",
        "unit transformer.h.0 for input float32 [8, 32, 64]: built in",
        "root piece root.after_units for input float32 [8, 32, 64]: built in"}) {
    EXPECT_NE(cold_log.find("compile: " + piece), std::string::npos) << piece << cold_log;
  }
  EXPECT_EQ(warm_log.find("side by side"), std::string::npos) << warm_log;
  EXPECT_EQ(warm_log.find("built in"), std::string::npos) << warm_log;
  EXPECT_NE(warm_log.find("compile: unit transformer.h.0 for input float32 [8, 32, 64]: cached"),
            std::string::npos)
      << warm_log;
}

// Evaluation with compile.root: the root's forward packages around the compiled units (no
// backward, nothing saved), its loss the eager model's; with compile.root = false the executor
// declines (the Trainer's eager root around the compiled units). gpt_config's shape: the packages
// of the tests above, through the shared cache.
TEST(CompiledUnits, EvaluationRunsTheCompiledRootAroundTheUnits) {
  TempDir dir;
  torch::manual_seed(11);
  const Batch batch{torch::randint(0, 256, {8, 32}, torch::kLong),
                    torch::randint(0, 256, {8, 32}, torch::kLong)};
  torch::NoGradGuard no_grad;  // as Trainer::evaluate calls it, the model in eval mode
  for (const bool root : {true, false}) {
    std::vector<std::string> keys = kUnitKeys;
    keys.push_back(std::string("compile.root=") + (root ? "true" : "false"));
    const Config config = gpt_config(dir.path(), keys);
    apply_runtime_settings(config);  // run.deterministic, as `kiln train` (part of the cache key)
    std::shared_ptr<Model> model = make_model(config);
    model->eval();
    const double eager = model->loss(model->forward(batch.inputs), batch.targets).item<double>();
    CompiledStep step(CompileOptions::from_config(config),
                      TrainOptions::from_config(config).precision, *model,
                      torch::Device(torch::kCPU));
    const StepExecutor::EvalOutputs out = step.evaluate(batch);
    if (!root) {
      EXPECT_FALSE(out.loss.defined());
      continue;
    }
    ASSERT_TRUE(out.loss.defined());
    EXPECT_NEAR(out.loss.item<double>(), eager, 1e-6 * eager);  // fp32, fused differently
    const nlohmann::json json = step.report().to_json();
    ASSERT_EQ(json["root"].size(), 2u) << json.dump();
    EXPECT_EQ(json["root"][1]["input"], "float32 [8, 32, 64]");
    EXPECT_EQ(step.report().compiled_unit_forwards, 2);  // both blocks, forward packages only
  }
}

// fp16-mixed in unit mode: the blocks' packages trace fp16 autocast; kiln's dynamic loss scaler
// stays outside them (the gradient reaching a unit's backward is already scaled). The root eager
// (compile.root = false: its fp16 pieces would be two more cold pairs). Last in the file: its
// pair is its own, so it waits on no other test's build.
TEST(CompiledUnits, HalfMixedUnitGraphsTrainAsEagerHalfMixed) {
  TempDir dir;
  const std::string fp16 = " --set train.precision=fp16-mixed";
  const std::string unit = std::string(" --set compile.backend=inductor --set compile.root=false") +
                           " --set compile.cache_dir=" + KILN_TEST_COMPILE_CACHE;
  std::string log;
  const auto eager = train_losses(dir, "eager_fp16", fp16, 4, nullptr);
  const auto compiled = train_losses(dir, "unit_fp16", fp16 + unit, 4, &log);
  const auto fp32 = train_losses(dir, "eager_fp32", "", 1, nullptr);
  ASSERT_EQ(eager.size(), 4u);
  EXPECT_NE(log.find("compile: unit transformer.h.0 for input float32 [8, 32, 64]"),
            std::string::npos)
      << log;
  // Measured: losses within 6.0e-6, the first step's gradient norm (the scaled backward,
  // unscaled by kiln) 3.2e-6 relative.
  EXPECT_LE(worst_relative(eager, compiled), 1e-4);
  const double norm = first_grad_norm(dir / "eager_fp16" / "metrics.jsonl");
  const double unit_norm = first_grad_norm(dir / "unit_fp16" / "metrics.jsonl");
  EXPECT_NEAR(unit_norm, norm, 1e-4 * norm);
  // The control, on that norm (before any update): the compiled blocks round as fp16-mixed
  // does, several times closer to eager fp16-mixed than to fp32 (a package traced without the
  // policy would match fp32). Measured 3.2e-6 vs 4.0e-5 relative.
  ASSERT_EQ(fp32.size(), 1u);
  const double fp32_norm = first_grad_norm(dir / "eager_fp32" / "metrics.jsonl");
  EXPECT_LT(3 * std::abs(unit_norm - norm), std::abs(unit_norm - fp32_norm));
}

}  // namespace
}  // namespace kiln::testing
