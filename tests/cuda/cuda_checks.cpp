// The CUDA paths, run by scripts/gpu-check on a GPU machine (ctest label `cuda`; scripts/test
// leaves them out: this machine has no GPU). Each test proves one path end to end: CUDA peak
// memory, checkpoints staged through pinned host buffers, NCCL at a world of one under torchrun
// (DDP, FSDP in bf16-mixed, DDP's all-reduce inside a CUDA graph), the CUDA profiler's kernel
// events and GPU verdict, bf16-mixed training, and the captured step (CUDA graphs) against eager.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ckpt/saving.h"
#include "kiln/compile.h"
#include "kiln/session.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using nlohmann::json;

json read_json(const std::filesystem::path& path) {
  return json::parse(slurp(path));
}

std::string gpt_args(const std::filesystem::path& dir, const std::string& name) {
  return fmt::format(
      "{} --set run.dir={} --set run.name={} --set run.device=cuda --set run.progress=off "
      "--set model.name=gpt --set model.preset=tiny --set data.name=text --set data.seq_len=64 "
      "--set train.batch_size=16 --set train.eval_every=0 --set train.eval_batches=2 "
      "--set data.num_workers=2",
      (source_dir() / "configs/gpt-tiny.toml").string(), dir.string(), name);
}

TEST(Cuda, DeviceIsThere) {
  ASSERT_TRUE(torch::cuda::is_available()) << "these tests need a CUDA device";
}

TEST(Cuda, PeakMemoryComesFromTheCachingAllocator) {
  const torch::Device device(torch::kCUDA, 0);
  reset_peak_memory(device);
  auto big = torch::empty({256, 1024, 1024}, torch::TensorOptions().device(device));  // 1 GiB
  big.fill_(1.0f);
  const PeakMemory peak = read_peak_memory(device);
  EXPECT_GE(peak.allocated_bytes, 1024.0 * 1024 * 1024);
  EXPECT_GE(peak.reserved_bytes, peak.allocated_bytes);
  EXPECT_NE(peak.method.find("CUDA"), std::string::npos) << peak.method;
}

// Every step's loss in a metrics file, by step (a resumed run appends to its file).
std::map<int64_t, double> step_losses(const std::filesystem::path& metrics) {
  std::map<int64_t, double> losses;
  std::istringstream lines(slurp(metrics));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    const json record = json::parse(line);
    if (record.contains("step") && record.contains("loss") && record["loss"].is_number())
      losses[record["step"].get<int64_t>()] = record["loss"].get<double>();
  }
  return losses;
}

// The two runs logged the same steps, at least `min_steps` of them, and each step's losses agree
// within `relative`: never a final loss that reads 0 when nothing was recorded.
void expect_same_losses(const std::filesystem::path& a, const std::filesystem::path& b,
                        size_t min_steps, double relative) {
  const auto la = step_losses(a), lb = step_losses(b);
  ASSERT_GE(la.size(), min_steps) << a;
  ASSERT_EQ(la.size(), lb.size()) << a << " vs " << b;
  for (const auto& [step, loss] : la) {
    ASSERT_TRUE(lb.contains(step)) << "step " << step << " missing from " << b;
    EXPECT_NEAR(lb.at(step), loss, relative * std::abs(loss)) << "step " << step;
  }
}

TEST(Cuda, ManifestNamesTheGpuAndBatchesRanThere) {
  TempDir dir;
  const CommandResult r = run_kiln("train " + gpt_args(dir.path(), "where") +
                                   " --set train.steps=3 --set train.metrics_every=1");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const json manifest = read_json(dir / "where" / "manifest.json");
  EXPECT_EQ(manifest.at("device").get<std::string>(), "cuda:0") << manifest.dump(2);
  EXPECT_EQ(step_losses(dir / "where" / "metrics.jsonl").size(), 3u);
}

// Sees, inside every unit's forward, what autocast does to a matmul on the unit's device.
class AutocastProbe : public UnitWrapper {
 public:
  torch::Tensor run(int, const UnitForward& forward, const torch::Tensor& input) override {
    const auto w = torch::ones({4, 4}, input.options().dtype(torch::kFloat32));
    dtypes.push_back(torch::mm(w, w).scalar_type());
    devices.push_back(input.device().str());
    return forward(input);
  }
  std::vector<torch::ScalarType> dtypes;
  std::vector<std::string> devices;
};

// An exported program on the GPU: the example's Python model imported on this machine (its
// torch is the LibTorch kiln was built with) and trained from C++ with run.device = "cuda": the
// graph's device arguments take the input's device, and the loss falls as on the CPU.
TEST(Cuda, ExportedProgramTrainsOnTheGpu) {
  TempDir dir;
  const std::string package = (dir / "convlm").string();
  const CommandResult imported = run_shell(fmt::format(
      "{} model import --module {}/examples/python_model/model.py:build --max-seq 64 --out {}",
      KILN_CLI, source_dir().string(), package));
  ASSERT_EQ(imported.exit_code, 0) << imported.err;
  const CommandResult trained = run_shell(fmt::format(
      "{} train {}/configs/gpt-tiny.toml --set run.dir={} --set run.device=cuda --set "
      "run.progress=off --set model.name=exported --set model.package={} --set train.steps=30 "
      "--set train.eval_every=0",
      KILN_CLI, source_dir().string(), dir.path().string(), package));
  ASSERT_EQ(trained.exit_code, 0) << trained.err;
  const json manifest = read_json(dir / "gpt-tiny" / "manifest.json");
  EXPECT_NE(manifest.dump().find("cuda"), std::string::npos);
  EXPECT_NE(trained.out.find("trained 30 steps"), std::string::npos) << trained.out;
}

TEST(Cuda, Bf16MixedRunsTheForwardInBf16OnTheGpu) {
  TempDir dir;
  const Config config = gpt_config(
      dir.path(), {"run.device=cuda", "train.precision=bf16-mixed", "data.num_workers=0"});
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config),
                  {.device = torch::Device(torch::kCUDA, 0)});
  auto probe = std::make_shared<AutocastProbe>();
  trainer.model().add_unit_wrapper(probe);
  trainer.train_step(/*sync=*/true);
  ASSERT_FALSE(probe->dtypes.empty()) << "the probe saw no unit forward";
  for (size_t k = 0; k < probe->dtypes.size(); ++k) {
    EXPECT_EQ(probe->dtypes[k], torch::kBFloat16) << "unit call " << k;
    EXPECT_EQ(probe->devices[k], "cuda:0") << "unit call " << k;
  }
  for (auto& p : trainer.model().parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
}

TEST(Cuda, CheckpointStagingUsesPinnedHostMemory) {
  const auto live_tensor = torch::randn({1024, 256}, torch::TensorOptions().device(torch::kCUDA));
  std::vector<torch::Tensor> buffers;
  const auto staged = ckpt::stage(buffers, {{"w", live_tensor}});
  ASSERT_EQ(staged.size(), 1u);
  EXPECT_TRUE(staged[0].second.is_cpu());
  EXPECT_TRUE(staged[0].second.is_pinned()) << "async staging of a CUDA tensor is not pinned";
  EXPECT_TRUE(torch::equal(staged[0].second, live_tensor.cpu()));
}

TEST(Cuda, CheckpointsStageThroughPinnedBuffersAndResume) {
  TempDir dir;
  const std::string common =
      gpt_args(dir.path(), "ckpt") + " --set checkpoint.every_steps=6 --set checkpoint.async=true";
  const CommandResult full =
      run_kiln("train " + common + " --set run.name=full --set train.steps=12");
  ASSERT_EQ(full.exit_code, 0) << full.out << full.err;
  const CommandResult first = run_kiln("train " + common + " --set train.steps=6");
  ASSERT_EQ(first.exit_code, 0) << first.out << first.err;
  const CommandResult resumed = run_kiln("train " + common + " --set train.steps=12 --resume auto");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  // CUDA kernels need not be bitwise across processes.
  expect_same_losses(dir / "full" / "metrics.jsonl", dir / "ckpt" / "metrics.jsonl", 12, 1e-4);
}

// One process under torchrun with dist.backend = "nccl": a real NCCL process group of one, DDP or
// FSDP attached over it (docs/scale.md), so every collective runs on the GPU.
CommandResult torchrun_one(const std::string& args) {
  return run_shell(
      fmt::format("{} --standalone --nproc-per-node 1 --no-python {} train {} "
                  "--set dist.backend=nccl",
                  KILN_TORCHRUN, KILN_CLI, args));
}

TEST(Cuda, NcclAtAWorldOfOneUnderTorchrun) {
  TempDir dir;
  const CommandResult r =
      torchrun_one(gpt_args(dir.path(), "nccl") + " --set train.steps=6 --set dist.strategy=ddp");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("process group: rank 0 of 1"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("data parallel over 1 ranks (nccl)"), std::string::npos) << r.err;
  const json manifest = read_json(dir / "nccl" / "manifest.json");
  EXPECT_NE(manifest.dump().find("nccl"), std::string::npos) << manifest.dump(2);
}

TEST(Cuda, FsdpInBf16MixedOnNcclMatchesOneProcess) {
  TempDir dir;
  const std::string common =
      gpt_args(dir.path(), "single") + " --set train.steps=20 --set train.precision=bf16-mixed";
  const CommandResult single = run_kiln("train " + common);
  ASSERT_EQ(single.exit_code, 0) << single.out << single.err;
  const CommandResult fsdp = torchrun_one(common + " --set run.name=fsdp --set dist.strategy=fsdp");
  ASSERT_EQ(fsdp.exit_code, 0) << fsdp.out << fsdp.err;
  EXPECT_NE(fsdp.err.find("fully sharded data parallel over 1 ranks (nccl)"), std::string::npos)
      << fsdp.err;
  // FSDP computes with bf16 parameters, autocast casts fp32 ones.
  expect_same_losses(dir / "single" / "metrics.jsonl", dir / "fsdp" / "metrics.jsonl", 20, 2e-2);
}

TEST(Cuda, CapturedStepWithDdpOnNccl) {
  TempDir dir;
  const std::string common = gpt_args(dir.path(), "eager") +
                             " --set train.steps=12 --set train.grad_accum_steps=2 "
                             "--set dist.strategy=ddp --set dist.bucket_mb=0.5";
  const CommandResult eager = torchrun_one(common);
  ASSERT_EQ(eager.exit_code, 0) << eager.out << eager.err;
  const CommandResult captured =
      torchrun_one(common +
                   " --set run.name=captured --set compile.backend=cudagraphs "
                   "--set compile.warmup_steps=3");
  ASSERT_EQ(captured.exit_code, 0) << captured.out << captured.err;
  EXPECT_NE(captured.err.find("captured into the step's CUDA graph"), std::string::npos)
      << captured.err;
  EXPECT_NE(captured.err.find("compile: captured the step"), std::string::npos) << captured.err;
  expect_same_losses(dir / "eager" / "metrics.jsonl", dir / "captured" / "metrics.jsonl", 12, 1e-4);
}

TEST(Cuda, ProfilerRecordsKernelsAndTheGpuVerdict) {
  TempDir dir;
  const CommandResult r =
      run_kiln("profile " + gpt_args(dir.path(), "prof") +
               " --set profile.skip_first=2 --set profile.warmup=1 --set profile.active=3");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const json profile = read_json(dir / "prof" / "profile.json");
  ASSERT_TRUE(profile["analysis"].contains("gpu")) << profile.dump(2);
  EXPECT_GT(profile["analysis"]["gpu"]["kernels"].get<double>(), 0);
  EXPECT_GT(profile["analysis"]["gpu"]["kernel_us"].get<double>(), 0);
  EXPECT_TRUE(profile["verdict"].contains("bottleneck"));
}

TEST(Cuda, Bf16MixedTrainsCloseToFp32) {
  TempDir dir;
  const std::string common = gpt_args(dir.path(), "fp32") + " --set train.steps=40";
  const CommandResult fp32 = run_kiln("train " + common);
  ASSERT_EQ(fp32.exit_code, 0) << fp32.out << fp32.err;
  const CommandResult bf16 =
      run_kiln("train " + common + " --set run.name=bf16 --set train.precision=bf16-mixed");
  ASSERT_EQ(bf16.exit_code, 0) << bf16.out << bf16.err;
  const auto fp32_losses = step_losses(dir / "fp32" / "metrics.jsonl");
  const auto bf16_losses = step_losses(dir / "bf16" / "metrics.jsonl");
  ASSERT_EQ(fp32_losses.size(), bf16_losses.size());
  ASSERT_FALSE(fp32_losses.empty());
  const double a = fp32_losses.rbegin()->second, b = bf16_losses.rbegin()->second;
  EXPECT_NEAR(b, a, 0.02 * a);
}

TEST(Cuda, CapturedStepReplaysMatchEager) {
  TempDir dir;
  const Config config = gpt_config(
      dir.path(), {"run.device=cuda", "compile.backend=cudagraphs", "compile.warmup_steps=3",
                   "train.grad_accum_steps=2", "optim.warmup_steps=5", "data.num_workers=0"});
  const torch::Device device(torch::kCUDA, 0);
  Trainer eager(TrainerSetup::from_config(config), make_model(config), make_datasets(config),
                {.device = device});
  Trainer captured(TrainerSetup::from_config(config), make_model(config), make_datasets(config),
                   {.device = device});
  auto step = attach_captured_step(captured, config);
  ASSERT_TRUE(step);
  auto eager_log = std::make_shared<StepLog>(), captured_log = std::make_shared<StepLog>();
  eager.add_hook(eager_log);
  captured.add_hook(captured_log);
  for (int k = 0; k < 12; ++k) {
    eager.train_step(/*sync=*/true);
    captured.train_step(/*sync=*/true);
  }
  EXPECT_EQ(step->eager_steps(), 3);
  EXPECT_EQ(step->replays(), 9);
  EXPECT_TRUE(step->report().breaks.empty());
  ASSERT_EQ(eager_log->steps.size(), 12u);
  ASSERT_EQ(captured_log->steps.size(), eager_log->steps.size());
  for (size_t k = 0; k < eager_log->steps.size(); ++k) {
    EXPECT_NEAR(captured_log->steps[k].loss, eager_log->steps[k].loss,
                1e-4 * std::abs(eager_log->steps[k].loss))
        << "step " << k + 1;
  }
}

TEST(Cuda, CompileRungWithInductorAndCudaGraphs) {
  TempDir dir;
  const CommandResult r =
      run_kiln("compile " + gpt_args(dir.path(), "compile") +
               " --set compile.backend=inductor+cudagraphs --set compile.warmup_steps=3 "
               "--set compile.steps=6 --set compile.probe_seq_lens=none --set model.n_layer=1");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const json c = read_json(dir / "compile" / "compile.json");
  EXPECT_TRUE(c["passed"].get<bool>()) << c.dump(2);
  // Both sides measured: a speedup from two real medians (the gate is c["passed"]).
  EXPECT_GT(c["eager"]["median_seconds"].get<double>(), 0);
  EXPECT_GT(c["compiled"]["median_seconds"].get<double>(), 0);
  EXPECT_NEAR(
      c["speedup"].get<double>(),
      c["eager"]["median_seconds"].get<double>() / c["compiled"]["median_seconds"].get<double>(),
      1e-6);
  ASSERT_TRUE(c.contains("capture"));
  EXPECT_EQ(c["capture"]["graphs"].size(), 1u);
}

}  // namespace
}  // namespace kiln::testing
