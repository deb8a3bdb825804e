// The forecast of one run, forecast against actual, the measured matmul peak in the plan, and
// host memory and storage: known answers worked by hand (docs/plan.md).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/plan.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

// gpt: L = 2, C = 32, V = 300, T = 16, micro-batch 4:
//   N (without the position embedding) = V C + L (12 C^2 + 13 C) + 2 C
//     = 9,600 + 2 x (12,288 + 416) + 64 = 35,072
//   FLOPs per token = 6 N + 12 L C T = 210,432 + 12,288 = 222,720
//   tokens per step (per device) = 4 x 16 = 64; FLOPs per step = 14,254,080
//   state: parameters 35,072 + position embedding 512 = 35,584 x 4 B = 142,336 B; AdamW twice
//   that: 284,672 B; checkpoint (parameters + optimizer) = 427,008 B.
Config forecast_config(const std::vector<std::string>& extra = {}) {
  Config config = Config::defaults();
  for (const auto& o :
       {"model.name=gpt", "data.name=text", "model.preset=tiny", "model.n_layer=2",
        "model.n_embd=32", "model.n_head=2", "model.vocab_size=300", "model.block_size=16",
        "data.seq_len=16", "train.batch_size=4", "train.steps=200"})
    config.set_from_string(o);
  for (const auto& o : extra) config.set_from_string(o);
  config.validate();
  return config;
}

TEST(Forecast, UncalibratedStepTimeIsFlopsOverPeakTimesMfu) {
  // peak 1e12 (baseline.peak_flops_per_second) x plan.mfu 0.5 = 5e11 FLOP/s:
  // step = 14,254,080 / 5e11 = 28.50816 us; tokens/s = 64 / step = 2,244,971.26;
  // 200 steps = 5.701632 ms.
  const Config config = forecast_config({"baseline.peak_flops_per_second=1e12", "plan.mfu=0.5"});
  const Forecast f = forecast_run(config, nullptr, "cpu", 1);
  EXPECT_DOUBLE_EQ(f.flops_per_step, 14'254'080.0);
  EXPECT_DOUBLE_EQ(f.tokens_per_step, 64.0);
  EXPECT_NEAR(f.step_seconds, 2.850816e-5, 1e-15);
  EXPECT_NEAR(f.tokens_per_second, 2'244'971.264, 1e-2);
  EXPECT_NEAR(f.train_seconds, 5.701632e-3, 1e-12);
  EXPECT_EQ(f.calibration, "uncalibrated");
  EXPECT_EQ(f.mfu_source, "plan.mfu (assumed)");
  EXPECT_DOUBLE_EQ(f.checkpoint_bytes, 427'008.0);
  EXPECT_DOUBLE_EQ(f.save_seconds, 427'008.0 / 2e9);  // plan.checkpoint_write_gb_per_second = 2
  // The memory forecast is the memory model's step peak, uncalibrated.
  JobShape job = job_shape(config);
  job.world_size = 1;
  EXPECT_DOUBLE_EQ(f.peak_memory_bytes, estimate_memory(model_shape(config), job).step_peak());
  // A catalog row: H100's fp32 67 TFLOP/s x plan.mfu 0.4 = 2.68e13: step = 531.87 ns.
  const Forecast h100 = forecast_run(forecast_config(), nullptr, "NVIDIA H100 80GB HBM3", 1);
  EXPECT_NEAR(h100.step_seconds, 5.318686567e-7, 1e-15);
  EXPECT_THAT(h100.peak_source, HasSubstr("h100-sxm"));
  // No peak known (a CPU, no override): no time forecast, memory still.
  const Forecast none = forecast_run(forecast_config(), nullptr, "cpu", 1);
  EXPECT_EQ(none.step_seconds, 0.0);
  EXPECT_THAT(forecast_text(none), HasSubstr("no step time"));
  EXPECT_GT(none.peak_memory_bytes, 427'008.0);
}

TEST(Forecast, APilotOnTheSameDeviceCalibratesEveryInput) {
  // The pilot's step took 10 ms on "cpu" and its matmul ran 2e9 FLOP/s: achieved =
  // 14,254,080 / 0.01 = 1.425408e9 FLOP/s, MFU = 1.425408e9 / 2e9 = 0.712704, so the forecast
  // step is the pilot's 10 ms and tokens/s 64 / 0.01 = 6,400. Save: 427,008 B at 1e8 B/s =
  // 4.27008 ms. Memory: held state + the working memory x 1.5.
  const Config config = forecast_config();
  PilotCalibration pilot;
  pilot.run_dir = "runs/p";
  pilot.device = "cpu";
  pilot.step_seconds = 0.01;
  pilot.matmul_peak_flops_per_second = 2e9;
  pilot.activation_ratio = 1.5;
  pilot.write_bytes_per_second = 1e8;
  const Forecast f = forecast_run(config, &pilot, "cpu", 1);
  EXPECT_DOUBLE_EQ(f.peak_flops_per_second, 2e9);
  EXPECT_NEAR(f.mfu, 0.712704, 1e-12);
  EXPECT_NEAR(f.step_seconds, 0.01, 1e-15);
  EXPECT_NEAR(f.tokens_per_second, 6400.0, 1e-9);
  EXPECT_NEAR(f.save_seconds, 4.27008e-3, 1e-15);
  EXPECT_EQ(f.calibration, "pilot runs/p");
  JobShape job = job_shape(config);
  job.world_size = 1;
  const MemoryEstimate m = estimate_memory(model_shape(config), job);
  const double held = m.parameters + m.optimizer;
  EXPECT_DOUBLE_EQ(held, 427'008.0);
  EXPECT_DOUBLE_EQ(f.peak_memory_bytes, held + 1.5 * (m.step_peak() - held));
  // Negative control: the same pilot does not calibrate another device.
  const Forecast other = forecast_run(config, &pilot, "NVIDIA H100 80GB HBM3", 1);
  EXPECT_DOUBLE_EQ(other.mfu, 0.4);
  EXPECT_DOUBLE_EQ(other.peak_flops_per_second, 67e12);
  EXPECT_DOUBLE_EQ(other.memory_calibration, 1.0);
}

TEST(Forecast, ComparisonNamesTheMostWrongInput) {
  Forecast f;
  f.step_seconds = 0.010;
  f.tokens_per_second = 6400;
  f.peak_memory_bytes = 1000;
  f.save_seconds = 2.0;
  ActualRun a;
  a.run_dir = "runs/a";
  a.device = "cpu";
  a.step_seconds = 0.0125;     // forecast / actual = 0.8
  a.tokens_per_second = 5120;  // 1.25
  a.steps = 100;
  a.train_seconds = 1.25;      // 100 x 0.010 / 1.25 = 0.8
  a.peak_memory_bytes = 1100;  // 0.909
  a.save_seconds = 1.0;        // 2.0: |ln 2| = 0.69 > |ln 0.8| = 0.22 > |ln 0.909| = 0.095
  nlohmann::json c = compare_forecast(f, a);
  ASSERT_EQ(c["rows"].size(), 5u);
  EXPECT_NEAR(c["rows"][0]["ratio"].get<double>(), 0.8, 1e-12);
  EXPECT_NEAR(c["rows"][1]["ratio"].get<double>(), 1.25, 1e-12);
  EXPECT_NEAR(c["rows"][2]["ratio"].get<double>(), 0.8, 1e-12);
  EXPECT_NEAR(c["rows"][3]["ratio"].get<double>(), 1000.0 / 1100.0, 1e-12);
  EXPECT_NEAR(c["rows"][4]["ratio"].get<double>(), 2.0, 1e-12);
  EXPECT_THAT(c["most_wrong"]["input"].get<std::string>(), HasSubstr("checkpoint write speed"));
  EXPECT_THAT(comparison_markdown(c), HasSubstr("| checkpoint save | "));
  // Without a recorded save, the step time's input (peak x MFU) is the most wrong.
  a.save_seconds = 0;
  c = compare_forecast(f, a);
  EXPECT_TRUE(c["rows"][4]["ratio"].is_null());
  EXPECT_THAT(c["most_wrong"]["input"].get<std::string>(), HasSubstr("achieved FLOP/s"));
  // |ln 1.25| = |ln 0.8|: either of the three rows it sets.
  EXPECT_NEAR(std::abs(std::log(c["most_wrong"]["ratio"].get<double>())), std::log(1.25), 1e-12);
}

TEST(Forecast, ThePlanUsesThePilotsMeasuredMatmulPeakAndWarnsOnTheCatalog) {
  // H100 fp32 catalog 67 TFLOP/s; the pilot measured 20 TFLOP/s: 67 / 20 = 3.35 > 1.25, warned.
  // MFU = achieved / measured = 1.425408e9 / 20e12 = 7.12704e-5.
  const Config config = forecast_config({"plan.hardware=h100-sxm"});
  PilotCalibration pilot;
  pilot.run_dir = "runs/p";
  pilot.device = "NVIDIA H100 80GB HBM3";
  pilot.step_seconds = 0.01;
  pilot.matmul_peak_flops_per_second = 20e12;
  nlohmann::json plan = make_plan(config, &pilot, false);
  const auto& row = plan["rows"][0];
  EXPECT_DOUBLE_EQ(row["peak_flops_per_gpu"].get<double>(), 20e12);
  EXPECT_DOUBLE_EQ(row["catalog_peak_flops_per_gpu"].get<double>(), 67e12);
  EXPECT_NEAR(row["mfu"].get<double>(), 7.12704e-5, 1e-15);
  ASSERT_EQ(plan["warnings"].size(), 1u);
  EXPECT_THAT(plan["warnings"][0].get<std::string>(), HasSubstr("3.35x"));
  EXPECT_THAT(plan_markdown(plan), HasSubstr("Warnings:"));
  // Negative control: 60 TFLOP/s measured (67 / 60 = 1.12): no warning.
  pilot.matmul_peak_flops_per_second = 60e12;
  plan = make_plan(config, &pilot, false);
  EXPECT_TRUE(plan["warnings"].empty());
  EXPECT_DOUBLE_EQ(plan["rows"][0]["peak_flops_per_gpu"].get<double>(), 60e12);
}

TEST(Forecast, HostMemoryStagingAndStorage) {
  // A node of 8 GPUs with 100 GB of host memory, 90 GB usable (plan.headroom 0.1).
  // Loader: 8 ranks x data.prefetch 4 x (4 x 16 tokens x 2 (input, target) x 8 B = 1,024 B)
  // = 32,768 B. DDP, async: rank 0 stages the whole checkpoint.
  Device d;
  d.name = "test-row";
  d.gpus_per_node = 8;
  d.host_memory_bytes = 100e9;
  StrategyDecision ddp;
  ddp.strategy = "ddp";
  const Config config = forecast_config();
  HostNeeds h = host_needs(config, d, 8, ddp, 50e9, 3600);
  EXPECT_DOUBLE_EQ(h.loader_bytes_per_node, 32'768.0);
  EXPECT_DOUBLE_EQ(h.staging_bytes_per_node, 50e9);
  EXPECT_TRUE(h.host_fits);
  // 95 GB staged + 32,768 B > 90 GB: warned, naming checkpoint.async.
  h = host_needs(config, d, 8, ddp, 95e9, 3600);
  EXPECT_FALSE(h.host_fits);
  ASSERT_EQ(h.warnings.size(), 1u);
  EXPECT_THAT(h.warnings[0], HasSubstr("checkpoint.async"));
  // FSDP over 16 GPUs: one replica's shards, 8 of 16 on a node: 95 GB x 8 / 16 = 47.5 GB.
  StrategyDecision fsdp;
  fsdp.strategy = "fsdp";
  fsdp.fsdp_degree = 16;
  h = host_needs(config, d, 16, fsdp, 95e9, 3600);
  EXPECT_DOUBLE_EQ(h.staging_bytes_per_node, 47.5e9);
  EXPECT_TRUE(h.host_fits);
  // Synchronous saves stage nothing.
  h = host_needs(forecast_config({"checkpoint.async=false"}), d, 8, ddp, 95e9, 3600);
  EXPECT_DOUBLE_EQ(h.staging_bytes_per_node, 0.0);
  EXPECT_TRUE(h.host_fits);

  // Storage 0.2 TB: keep_last_k 3 x 50 GB = 150 GB fits (a save every hour: 168 in 7 days, 3
  // kept); keep_last_k 5: 250 GB does not. A save every 3 days: 3 in 7 days, so 3 of 5 kept.
  h = host_needs(forecast_config({"plan.storage_tb=0.2"}), d, 8, ddp, 50e9, 3600);
  EXPECT_DOUBLE_EQ(h.storage_bytes, 150e9);
  EXPECT_TRUE(h.storage_fits);
  const Config keep5 = forecast_config({"plan.storage_tb=0.2", "checkpoint.keep_last_k=5"});
  h = host_needs(keep5, d, 8, ddp, 50e9, 3600);
  EXPECT_DOUBLE_EQ(h.storage_bytes, 250e9);
  EXPECT_FALSE(h.storage_fits);
  ASSERT_EQ(h.warnings.size(), 1u);
  EXPECT_THAT(h.warnings[0], HasSubstr("plan.storage_tb"));
  h = host_needs(keep5, d, 8, ddp, 50e9, 3 * 86400.0);
  EXPECT_DOUBLE_EQ(h.storage_bytes, 150e9);
  // Not set: never checked.
  h = host_needs(forecast_config({"checkpoint.keep_last_k=5"}), d, 8, ddp, 50e12, 3600);
  EXPECT_TRUE(h.storage_fits);
  // A negative storage is refused by the schema, naming the key.
  try {
    forecast_config({"plan.storage_tb=-1"});
    ADD_FAILURE() << "a negative plan.storage_tb was accepted";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), HasSubstr("plan.storage_tb"));
  }
}

TEST(Forecast, MatmulPeakTimesTheJobsShapeInItsPrecision) {
  const Config config = forecast_config();
  JobShape job = job_shape(config);
  const MatmulShape s = job_matmul_shape(model_shape(config), job);
  EXPECT_EQ(s.m, 64);   // micro-batch 4 x seq 16
  EXPECT_EQ(s.k, 32);   // n_embd
  EXPECT_EQ(s.n, 128);  // 4 n_embd
  const MatmulPeak p = measure_matmul_peak(s, "fp32", "cpu", 0.02);
  EXPECT_EQ(p.dtype, "float32");
  EXPECT_GE(p.repeats, 5);
  ASSERT_GT(p.median_seconds, 0.0);
  EXPECT_NEAR(p.flops_per_second, 2.0 * 64 * 32 * 128 / p.median_seconds,
              1e-9 * p.flops_per_second);
  EXPECT_EQ(measure_matmul_peak({8, 8, 8}, "bf16-mixed", "cpu", 0.0).dtype, "bfloat16");
  EXPECT_EQ(to_json(p)["m"], 64);
  EXPECT_THROW(measure_matmul_peak(s, "fp32", "nonsense", 0.0), std::exception);
  // The mlp: [micro-batch, input_dim] x [input_dim, hidden_dim].
  const Config mlp = [] {
    Config c = Config::defaults();
    c.set_from_string("model.name=mlp");
    c.set_from_string("model.input_dim=7");
    c.set_from_string("model.hidden_dim=33");
    c.set_from_string("train.batch_size=5");
    c.validate();
    return c;
  }();
  const MatmulShape ms = job_matmul_shape(model_shape(mlp), job_shape(mlp));
  EXPECT_EQ(ms.m, 5);
  EXPECT_EQ(ms.k, 7);
  EXPECT_EQ(ms.n, 33);
}

}  // namespace
}  // namespace kiln::testing
