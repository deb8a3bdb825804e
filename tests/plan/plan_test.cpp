// The plan component: the known answers, the catalog, the budget and the bad-input errors
// (docs/plan.md); the analytic model of a model in plan_model_test.cpp.
#include "kiln/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kiln/error.h"
#include "kiln/models.h"
#include "kiln/results.h"
#include "plan/catalog_fixture.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

Config config_with(const std::vector<std::string>& overrides) {
  Config config = Config::defaults();
  for (const auto& o : overrides) config.set_from_string(o);
  config.validate();
  return config;
}

Config gpt_6_7b() {
  return Config::load(source_dir() / "configs" / "gpt-6.7b.toml");
}

// Known answers, worked by hand.
//
// gpt-6.7b (configs/gpt-6.7b.toml: L = 32, C = 4096, V = 32000, block 2048):
//   N = V C + block C + L (12 C^2 + 13 C) + 2 C
//     = 131,072,000 + 8,388,608 + 32 x 201,379,840 + 8,192 = 6,583,623,680 parameters;
//   fp32 AdamW: 4 (parameter) + 4 (gradient) + 8 (two moments) = 16 B each:
//   16 x 6,583,623,680 = 105.34 GB of state, more than an 80 GB device holds, so DDP (every
//   device the whole state) never fits an H100 or an A100 80GB, at any GPU count; FSDP over 8
//   holds 105.34 / 8 = 13.17 GB of it per device. An MI300X (192 GB, 172.8 GB usable at 10%
//   headroom) holds it under DDP.
TEST(PlanKnownAnswers, SixPointSevenBillionOnEightyGigabyteDevices) {
  const Config config = gpt_6_7b();
  const ModelShape shape = model_shape(config);
  EXPECT_EQ(analytic_parameter_count(shape), 6'583'623'680);
  const JobShape job = job_shape(config);
  EXPECT_EQ(state_bytes_per_parameter(job), 16);
  const auto catalog = load_catalog();
  const Device& h100 = find_device(catalog, "h100-sxm", "test");
  const Device& a100 = find_device(catalog, "a100-80gb-sxm", "test");
  for (const Device* device : {&h100, &a100}) {
    for (int64_t gpus : {1, 2, 4, 8, 16, 64}) {
      JobShape at = job;
      at.world_size = gpus;
      const StrategyInput in = strategy_input(shape, at, device->memory_bytes, 0.1);
      EXPECT_NEAR(in.ddp_model_state_bytes, 105.34e9, 0.01e9);
      const StrategyDecision d = choose_strategy(in);
      EXPECT_NE(d.strategy, "ddp") << device->name << " x" << gpus;
    }
  }
  JobShape eight = job;
  eight.world_size = 8;
  const StrategyInput in = strategy_input(shape, eight, h100.memory_bytes, 0.1);
  const StrategyDecision d = choose_strategy(in);
  EXPECT_EQ(d.strategy, "fsdp");
  EXPECT_NEAR(in.ddp_model_state_bytes / 8, 13.17e9, 0.01e9);
  EXPECT_THAT(d.reason, HasSubstr("fsdp over"));
  JobShape one = job;
  one.world_size = 1;
  const Device& mi300x = find_device(catalog, "MI300X", "test");
  EXPECT_EQ(mi300x.memory_bytes, 192e9);
  EXPECT_EQ(choose_strategy(strategy_input(shape, one, mi300x.memory_bytes, 0.1)).strategy, "ddp");
}

// Young: delta = 60 s, M = 3.1 h = 11,160 s: sqrt(2 x 60 x 11,160) = sqrt(1,339,200) = 1157.2 s.
// Recovery-aware with R = 10 min = 600 s: 60 + sqrt(2 x (11,160 + 600) x 60 + 60^2)
//   = 60 + sqrt(1,414,800) = 60 + 1189.45 = 1249.45 s.
TEST(PlanKnownAnswers, CheckpointIntervals) {
  EXPECT_NEAR(young_interval_seconds(60, 3.1 * 3600), 1157.2, 0.05);
  EXPECT_NEAR(recovery_aware_interval_seconds(60, 3.1 * 3600, 600), 1249.45, 0.01);
  EXPECT_EQ(young_interval_seconds(60, 0), 0);
  EXPECT_EQ(recovery_aware_interval_seconds(60, 0, 600), 0);
}

// The budget with failures, by hand: W = 1000 steps x 1 s; delta = 60 s, R = 600 s, M = 3.1 h
// for the job (one GPU of MTBF 3.1 h). Tc = 1249.45 s (above); saves: W / (Tc - delta) x delta
// = 1000 / 1189.45 x 60 = 50.44 s; each failure loses Tc / 2 + R = 1224.73 s, a share
// 1224.73 / 11,160 = 0.10974 of the time; the run: (1000 + 50.44) / (1 - 0.10974) = 1179.93 s;
// expected failures 1179.93 / 11,160 = 0.1057, losing 129.49 s; ETTR 1000 / 1179.93 = 0.8475.
TEST(PlanBudget, KnownAnswerWithFailuresAndRestarts) {
  BudgetInput in;
  in.steps = 1000;
  in.compute_seconds_per_step = 0.75;
  in.communication_seconds_per_step = 0.25;
  in.save_seconds = 60;
  in.restart_seconds = 600;
  in.gpus = 1;
  in.gpu_mtbf_hours = 3.1;
  const Budget b = budget(in);
  EXPECT_DOUBLE_EQ(b.step_seconds, 1.0);
  EXPECT_DOUBLE_EQ(b.train_seconds, 1000);
  EXPECT_NEAR(b.checkpoint_interval_seconds, 1249.45, 0.01);
  EXPECT_NEAR(b.young_interval_seconds, 1157.2, 0.05);
  EXPECT_NEAR(b.saves_seconds, 50.44, 0.01);
  EXPECT_NEAR(b.wall_seconds, 1179.93, 0.01);
  EXPECT_NEAR(b.expected_failures, 0.1057, 0.0001);
  EXPECT_NEAR(b.lost_seconds, 129.49, 0.01);
  EXPECT_NEAR(b.ettr, 0.8475, 0.0001);
  // The drills (restart + save each), the pilot and a 10% margin on top: 1.1 x (1179.93 + 660 +
  // 3600) = 5983.92 s.
  in.restore_drills = 1;
  in.pilot_seconds = 3600;
  in.margin_fraction = 0.1;
  EXPECT_NEAR(budget(in).wall_seconds, 5983.92, 0.01);
  // Failures faster than progress: never finishes.
  in.gpu_mtbf_hours = 0.1;
  EXPECT_FALSE(std::isfinite(budget(in).wall_seconds));
  // No failure model: no saves for it, no losses.
  in.gpu_mtbf_hours = 0;
  const Budget quiet = budget(in);
  EXPECT_EQ(quiet.saves_seconds, 0);
  EXPECT_EQ(quiet.expected_failures, 0);
}

// A job's days by hand: gpt-6.7b in bf16 on one MI300X (DDP, no communication) at MFU 0.5.
//   FLOPs per token: 6 (N - block C) + 12 L C T = 6 x 6,575,235,072 + 12 x 32 x 4096 x 2048
//     = 42,672,635,904;
//   tokens per step: 1 x 2048 x 64 (micro-batch x seq x accumulation) = 131,072;
//   plan.tokens 1,310,720,000 = 10,000 steps;
//   one step: 42,672,635,904 x 131,072 / (0.5 x 1307.4e12) = 8.5562 s; 10,000 steps: 85,562 s
//   = 0.9903 days; one evaluation of one batch (2048 tokens at a third of the training FLOPs):
//   0.045 s. No failures, pilot, drills or margin: 0.9903 days.
TEST(PlanKnownAnswers, DaysFromStepsTokensAndMfu) {
  Config config = gpt_6_7b();
  for (const char* o :
       {"train.precision=bf16-mixed", "plan.hardware=mi300x", "plan.gpus=1", "plan.mfu=0.5",
        "plan.tokens=1310720000", "train.eval_every=0", "train.eval_batches=1",
        "plan.gpu_mtbf_hours=0", "plan.pilot_hours=0", "plan.margin=0", "plan.restore_drills=0"})
    config.set_from_string(o);
  const PlanResult plan = make_plan(config, nullptr, /*require_cost=*/false);
  EXPECT_EQ(plan.steps, 10000);
  EXPECT_EQ(plan.flops_per_token, 42'672'635'904.0);
  ASSERT_EQ(plan.rows.size(), 1u);
  const PlanRow& row = plan.rows[0];
  EXPECT_EQ(row.strategy, "ddp");
  EXPECT_EQ(row.communication_seconds_per_step, 0);
  EXPECT_NEAR(row.step_seconds, 8.5562, 0.0001);
  ASSERT_TRUE(row.wall_days.has_value());
  EXPECT_NEAR(*row.wall_days, 0.9903, 0.0001);
  EXPECT_NEAR(row.ettr, 1.0, 1e-6);
}

TEST(PlanCatalog, EveryRowHasItsPeaksSourceAndDate) {
  const auto catalog = load_catalog();
  std::vector<std::string> names;
  for (const auto& d : catalog) {
    names.push_back(d.name);
    for (const char* precision : {"fp32", "tf32", "bf16", "fp16"}) {
      EXPECT_GT(d.peak_flops_for(precision), 0) << d.name << " " << precision;
    }
    EXPECT_FALSE(d.source.empty());
    EXPECT_FALSE(d.date.empty());
  }
  EXPECT_THAT(names,
              ::testing::IsSupersetOf({"a100-80gb-sxm", "h100-sxm", "h200-sxm", "mi300x", "b200"}));
  const Device& h100 = find_device(catalog, "h100-sxm", "k");
  EXPECT_EQ(h100.peak_flops_for("bf16"), 989.5e12);
  EXPECT_EQ(h100.memory_bytes, 80e9);
  EXPECT_EQ(device_for_name(catalog, "NVIDIA H100 80GB HBM3"), &h100);
  EXPECT_EQ(device_for_name(catalog, "cpu"), nullptr);
}

TEST(PlanCatalog, UnknownHardwareSuggestsTheClosest) {
  const auto catalog = load_catalog();
  try {
    find_device(catalog, "h100-sx", "plan.hardware");
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), HasSubstr("plan.hardware"));
    EXPECT_THAT(e.what(), HasSubstr("did you mean \"h100-sxm\""));
  }
}

TEST(PlanCatalog, UserRowsAddAndReplace) {
  TempDir dir;
  write_text(dir / "mine.toml", R"([device.h100-sxm]
memory_gb = 94
memory_bandwidth_gb_per_s = 3900
interconnect_gb_per_s = 600
network_gb_per_s = 50
peak_tflops = { fp32 = 60, tf32 = 400, bf16 = 800, fp16 = 800 }
source = "my cluster"
date = "2026-11"

[device.my-gpu]
memory_gb = 24
memory_bandwidth_gb_per_s = 900
interconnect_gb_per_s = 64
network_gb_per_s = 12.5
peak_tflops = { fp32 = 80, bf16 = 160 }
source = "mine"
date = "2026-11"
)");
  const auto catalog = load_catalog(dir / "mine.toml");
  EXPECT_EQ(find_device(catalog, "h100-sxm", "k").memory_bytes, 94e9);
  EXPECT_EQ(find_device(catalog, "my-gpu", "k").peak_flops_for("tf32"), 0);
  write_text(dir / "bad.toml", "[device.x]\nmemory_gb = 24\n");
  EXPECT_THROW(load_catalog(dir / "bad.toml"), UserError);
}

TEST(Plan, SixPointSevenBillionPlan) {
  Config config = gpt_6_7b();
  const PlanResult plan = make_plan(config, nullptr, /*require_cost=*/false);
  ASSERT_EQ(plan.rows.size(), load_catalog().size());
  for (const PlanRow& row : plan.rows) {
    const std::string& name = row.hardware;
    const std::string& strategy = row.strategy;
    if (name == "mi300x" || name == "b200") {
      EXPECT_EQ(strategy, "ddp") << name;
    } else if (name == "h200-sxm") {
      EXPECT_NE(strategy, "does-not-fit");
    } else {
      EXPECT_EQ(strategy, "fsdp") << name;
    }
    ASSERT_TRUE(row.wall_seconds.has_value()) << name;
    EXPECT_GT(*row.wall_seconds, row.train_seconds);
    EXPECT_GT(row.ettr, 0);
    EXPECT_LT(row.ettr, 1);
    EXPECT_FALSE(row.reservation_7d.cost.has_value());
  }
  EXPECT_FALSE(plan.assumptions.empty());
  EXPECT_THAT(plan_markdown(plan), HasSubstr("| h100-sxm |"));
}

// train.precision = "bf16-mixed" computes in bf16: each row's compute time uses its bf16 peak
// (the same FLOPs over a larger peak); its memory adds autocast's weight copies.
TEST(Plan, MixedPrecisionUsesTheHalfPrecisionPeak) {
  Config fp32 = gpt_6_7b();
  Config bf16 = gpt_6_7b();
  bf16.set_from_string("train.precision=bf16-mixed");
  const PlanResult a = make_plan(fp32, nullptr, /*require_cost=*/false);
  const PlanResult b = make_plan(bf16, nullptr, /*require_cost=*/false);
  ASSERT_EQ(a.rows.size(), b.rows.size());
  const auto catalog = load_catalog();
  for (size_t k = 0; k < a.rows.size(); ++k) {
    const PlanRow& ra = a.rows[k];
    const PlanRow& rb = b.rows[k];
    const Device& d = find_device(catalog, ra.hardware, "k");
    EXPECT_EQ(rb.peak_flops_per_gpu, d.peak_flops_for("bf16")) << d.name;
    EXPECT_EQ(d.peak_flops_for("bf16-mixed"), d.peak_flops_for("bf16"));
    EXPECT_NEAR(ra.compute_seconds_per_step / rb.compute_seconds_per_step,
                d.peak_flops_for("bf16") / d.peak_flops_for("fp32"), 1e-9)
        << d.name;
  }
  // Autocast's bf16 copies of the linear weights live at the loss's backward: 2 B x (32 blocks x
  // 12 x 4096^2 + the tied head's 32000 x 4096) = 2 x 6,573,522,944 = 13,147,045,888 B. fp32
  // has none.
  EXPECT_EQ(b.memory_per_device.estimate.autocast_copies_bytes, 13'147'045'888.0);
  EXPECT_EQ(a.memory_per_device.estimate.autocast_copies_bytes, 0);
  EXPECT_EQ(compute_precision("FP16-mixed"), "fp16");
  EXPECT_EQ(compute_precision("tf32"), "tf32");
}

TEST(Plan, CostsTheCheapestRowThatFits) {
  Config config = gpt_6_7b();
  config.set_from_string("plan.hardware=h100-sxm, mi300x");
  config.set_from_string("plan.tokens=2e9");
  config.set_from_string("plan.price_7d_per_gpu_hour={ h100-sxm = 3.0, mi300x = 2.0 }");
  config.set_from_string("plan.price_30d_per_gpu_hour={ h100-sxm = 2.0, mi300x = 1.5 }");
  const PlanResult plan = make_plan(config, nullptr, /*require_cost=*/true);
  ASSERT_EQ(plan.rows.size(), 2u);
  const PlanRow& h100 = plan.rows[0];
  ASSERT_TRUE(h100.reservation_7d.cost && h100.reservation_30d.cost);
  EXPECT_DOUBLE_EQ(*h100.reservation_7d.cost, 8 * 7 * 24 * 3.0);
  EXPECT_DOUBLE_EQ(*h100.reservation_30d.cost, 8 * 30 * 24 * 2.0);
  // By hand: 8 GPUs x 7 days x 24 h x price: h100-sxm 4032, mi300x 2688; 30 days at the 30-day
  // prices: h100-sxm 11,520, mi300x 8640. 2e9 tokens take about two days on either, so every
  // reservation fits and the cheapest is the MI300X's 7 days at 2688.
  ASSERT_TRUE(plan.rows[1].reservation_7d.cost.has_value());
  EXPECT_DOUBLE_EQ(*plan.rows[1].reservation_7d.cost, 2688);
  EXPECT_TRUE(plan.rows[1].reservation_7d.fits);
  ASSERT_TRUE(plan.recommendation.has_value());
  EXPECT_EQ(plan.recommendation->hardware, "mi300x");
  EXPECT_EQ(plan.recommendation->reservation_days, 7);
  ASSERT_TRUE(plan.recommendation->cost.has_value());
  EXPECT_DOUBLE_EQ(*plan.recommendation->cost, 2688);
  // A two-day job is worth the reservation; each cost cell says it is a cost.
  EXPECT_FALSE(plan.recommendation->reservation_needed.has_value());
  EXPECT_FALSE(nlohmann::json(plan)["recommendation"].contains("reservation_needed"));
  EXPECT_THAT(plan.recommendation_text, HasSubstr("mi300x for 7 days"));
  EXPECT_THAT(plan_markdown(plan), HasSubstr("| fits, cost 2688 |"));
}

// configs/gpt-tiny.toml (1M parameters, 300 steps): sizes in MB rather than "0.0 GB", the
// precision in the header, an ETTR that is small but not "0.0%" (the wall time is mostly the
// pilot's hour), and no 7-day reservation for a job of about an hour.
TEST(Plan, ATinyJobReadsInItsOwnUnitsAndIsNotToldToReserve) {
  const PlanResult plan = make_plan(Config::load(source_dir() / "configs" / "gpt-tiny.toml"),
                                    nullptr, /*require_cost=*/false);
  const std::string text = plan_markdown(plan);
  EXPECT_THAT(text, HasSubstr("on 8 GPUs in fp32 (train.precision)"));
  EXPECT_THAT(text, Not(HasSubstr("0.0 GB")));
  EXPECT_THAT(text, HasSubstr(" MB/device (state "));
  EXPECT_THAT(text, Not(HasSubstr("| 0.0% |")));
  for (const PlanRow& row : plan.rows) {
    ASSERT_TRUE(row.wall_seconds.has_value()) << row.hardware;
    EXPECT_LT(*row.wall_seconds, 86400.0);
    EXPECT_GT(row.ettr, 0);
  }
  ASSERT_TRUE(plan.recommendation.has_value());
  EXPECT_EQ(plan.recommendation->reservation_needed, std::optional<bool>(false));
  const std::string advice = plan.recommendation_text;
  EXPECT_THAT(advice, HasSubstr("far less than the shortest reservation (7 days)"));
  EXPECT_THAT(advice, Not(HasSubstr("for 7 days")));
}

TEST(Plan, MissingPriceOrMtbfNamesTheKey) {
  Config config = gpt_6_7b();
  config.set_from_string("plan.hardware=h100-sxm");
  config.set_from_string("plan.price_7d_per_gpu_hour.h100-sxm=3.0");
  try {
    make_plan(config, nullptr, true);
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), HasSubstr("plan.price_30d_per_gpu_hour.h100-sxm"));
  }
  config.set_from_string("plan.price_30d_per_gpu_hour.h100-sxm=2.0");
  config.set_from_string("plan.gpu_mtbf_hours=0");
  try {
    make_plan(config, nullptr, true);
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), HasSubstr("plan.gpu_mtbf_hours"));
  }
}

// Bad input is one error naming the key: a price for a row the catalog lacks (the closest named),
// a price that is not positive, a catalog row without a field.
TEST(Plan, BadPricesAndRowsNameTheKey) {
  auto error_of = [](const Config& config) {
    try {
      make_plan(config, nullptr, /*require_cost=*/false);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  Config config = gpt_6_7b();
  config.set_from_string("plan.price_7d_per_gpu_hour={ h100 = 2.5 }");
  EXPECT_THAT(error_of(config), HasSubstr("plan.price_7d_per_gpu_hour.h100: unknown hardware"));
  EXPECT_THAT(error_of(config), HasSubstr("did you mean \"h100-sxm\""));
  config.set_from_string("plan.price_7d_per_gpu_hour={ h100-sxm = 0 }");
  EXPECT_THAT(error_of(config),
              HasSubstr("plan.price_7d_per_gpu_hour.h100-sxm = 0: a price per GPU-hour must be "
                        "positive"));
  TempDir dir;
  write_text(dir / "bad.toml", R"([device.x]
memory_gb = 24
interconnect_gb_per_s = 64
network_gb_per_s = 12.5
peak_tflops = { bf16 = 160 }
source = "mine"
date = "2026-11"
)");
  config = gpt_6_7b();
  config.set_from_string("plan.catalog=" + (dir / "bad.toml").string());
  EXPECT_THAT(error_of(config), HasSubstr("[device.x]: missing memory_bandwidth_gb_per_s"));
  write_text(dir / "zero.toml", R"([device.x]
memory_gb = 24
memory_bandwidth_gb_per_s = 0
interconnect_gb_per_s = 64
network_gb_per_s = 12.5
peak_tflops = { bf16 = 160 }
source = "mine"
date = "2026-11"
)");
  config.set_from_string("plan.catalog=" + (dir / "zero.toml").string());
  EXPECT_THAT(error_of(config),
              HasSubstr("[device.x]: memory_bandwidth_gb_per_s must be positive"));
}

// At a million GPUs more GPUs are not the way out: the advice names what limits. gpt-6.7b's
// GPUs fail every 50,676 h / 10^6 = 182 s as a job, less than a checkpoint period plus a restart;
// 2048 x 64 x 10^6 = 1.3e11 tokens per step leave 1 step for 1e11 tokens.
TEST(Plan, AtAMillionGpusTheAdviceSaysWhatLimits) {
  Config config = gpt_6_7b();
  config.set_from_string("plan.gpus=1000000");
  config.set_from_string("plan.tokens=1e11");
  const PlanResult plan = make_plan(config, nullptr, /*require_cost=*/false);
  const std::string& advice = plan.recommendation_text;
  EXPECT_THAT(advice, HasSubstr("nothing fits a 30-day reservation at 1000000 GPUs"));
  EXPECT_THAT(advice, HasSubstr("failures: the job's MTBF"));
  EXPECT_THAT(advice, HasSubstr("the global batch"));
  EXPECT_THAT(advice, Not(HasSubstr("add GPUs")));
}

TEST(Plan, CliPlansWithoutBuildingTheModel) {
  TempDir dir;
  // 70B-class shape: building it would need ~280 GB; planning takes no memory to speak of.
  auto plan = run_kiln("plan " + (source_dir() / "configs" / "gpt-6.7b.toml").string() +
                       " --set run.dir=" + dir.path().string() +
                       " --set model.n_layer=80 --set model.n_embd=8192 --set model.n_head=64");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_THAT(plan.out, HasSubstr("| h100-sxm |"));
  EXPECT_THAT(plan.out, HasSubstr("Recommendation:"));
  EXPECT_GT(read_result<PlanResult>(dir / "gpt-6.7b" / "plan.json").parameters, 60e9);
  // A runtime name for a catalog row: the row it means, in one line, exit 2.
  auto unknown = run_kiln("plan " + (source_dir() / "configs" / "gpt-6.7b.toml").string() +
                          " --set run.dir=" + dir.path().string() + " --set plan.hardware=h100");
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("did you mean \"h100-sxm\""));
  EXPECT_EQ(std::count(unknown.err.begin(), unknown.err.end(), '\n'), 1) << unknown.err;
}

// The checkpoint stall a run loses, by hand (docs/plan.md, "Forecast against actual"). gpt
// L 2, C 32, V 300, T 16, micro-batch 4 (tests/plan/forecast_test.cpp): the checkpoint is
// 427,008 B; the pilot on "cpu" wrote 1e8 B/s (a whole save 4.27008 ms), evaluated in 1 ms and
// blocked 0.5 ms in an async save (capture + staging). 200 steps at 10 ms, a save every 50: 4.
// Async: 4 x 0.5 ms, and the last save's write that the final evaluation does not cover,
// 4.27008 - 1 = 3.27008 ms: 5.27008 ms; wall = 2 s + 5.27008 ms + 2 evaluations x 1 ms.
// Synchronous: 4 x 4.27008 ms = 17.08032 ms.
Config stall_config(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> o = {
      "model.name=gpt",        "data.name=text",      "model.preset=tiny",
      "model.n_layer=2",       "model.n_embd=32",     "model.n_head=2",
      "model.vocab_size=300",  "model.block_size=16", "data.seq_len=16",
      "train.batch_size=4",    "train.steps=200",     "checkpoint.every_steps=50",
      "plan.hardware=this-cpu"};
  o.insert(o.end(), extra.begin(), extra.end());
  return config_with(o);
}

// A run over a mesh is forecast per device: under TP 2 a rank's share of the step's tokens is
// half its data-parallel rank's batch (4 x 16 / 2), the peak memory a rank's of TP 2 x FSDP 2
// (the walk per rank of the mesh), and the checkpoint every tensor once (427,008 B, as in one
// process: the pilot's write speed counts every rank's files). The control: the same job with
// no TP is forecast a whole batch per device.
TEST(PlanForecast, AMeshRunIsForecastPerDevice) {
  TempDir dir;
  write_this_cpu_catalog(dir / "cpu.toml");
  const std::string catalog = "plan.catalog=" + (dir / "cpu.toml").string();
  const Forecast one = forecast_run(stall_config({catalog}), nullptr, "cpu", 1, "none");
  const Forecast mesh = forecast_run(stall_config({catalog, "dist.tp=2", "dist.strategy=fsdp"}),
                                     nullptr, "cpu", 4, "fsdp");
  const Forecast flat =
      forecast_run(stall_config({catalog, "dist.strategy=fsdp"}), nullptr, "cpu", 4, "fsdp");
  EXPECT_DOUBLE_EQ(one.tokens_per_step, 64.0);
  EXPECT_DOUBLE_EQ(mesh.tokens_per_step, 32.0);
  EXPECT_DOUBLE_EQ(flat.tokens_per_step, 64.0);
  EXPECT_DOUBLE_EQ(mesh.checkpoint_bytes, 427'008.0);
  EXPECT_DOUBLE_EQ(flat.checkpoint_bytes, one.checkpoint_bytes);
  EXPECT_LT(mesh.peak_memory_bytes, one.peak_memory_bytes);
}

// An auto run's forecast reads the layout it ran from its strategy.json (kiln train writes it
// once the strategy is resolved): auto chose FSDP 2 x TP 2, so a rank holds half a batch's
// tokens, as the dist.tp = 2 forecast above. Controls: without strategy.json the config's keys
// stand (auto read as ddp, tp 1: a whole batch); a record of another world is not this run's.
TEST(PlanForecast, AnAutoRunIsForecastOverTheMeshItRecorded) {
  TempDir dir;
  write_this_cpu_catalog(dir / "cpu.toml");
  const Config config =
      stall_config({"plan.catalog=" + (dir / "cpu.toml").string(), "dist.strategy=auto"});
  const auto run = dir / "run";
  std::filesystem::create_directories(run);
  const RunLayout none = run_layout(config, run, 4);
  EXPECT_EQ(none.strategy, "ddp");
  EXPECT_EQ(none.tp, 0);
  EXPECT_EQ(none.source, "the config (no strategy.json)");
  EXPECT_DOUBLE_EQ(
      forecast_run(config, nullptr, "cpu", 4, none.strategy, none.tp, none.dp_replicate)
          .tokens_per_step,
      64.0);

  StrategyRecord record;
  record.strategy = "fsdp";
  record.reason = "auto";
  record.world_size = 4;
  record.dp_shard = 2;
  record.tp = 2;
  write_text(run / "strategy.json", nlohmann::json(record).dump());
  const RunLayout recorded = run_layout(config, run, 4);
  EXPECT_EQ(recorded.strategy, "fsdp");
  EXPECT_EQ(recorded.tp, 2);
  EXPECT_EQ(recorded.dp_replicate, 1);
  EXPECT_EQ(recorded.source, "strategy.json");
  const Forecast f = forecast_run(config, nullptr, "cpu", 4, recorded.strategy, recorded.tp,
                                  recorded.dp_replicate);
  EXPECT_DOUBLE_EQ(f.tokens_per_step, 32.0);
  const Forecast keys = forecast_run(stall_config({"plan.catalog=" + (dir / "cpu.toml").string(),
                                                   "dist.tp=2", "dist.strategy=fsdp"}),
                                     nullptr, "cpu", 4, "fsdp");
  EXPECT_DOUBLE_EQ(f.peak_memory_bytes, keys.peak_memory_bytes);
  EXPECT_EQ(run_layout(config, run, 8).source, "the config (no strategy.json)");
}

TEST(PlanForecast, AnAsyncJobLosesThePilotsBlockingTimeAndEndWaitPerSaveASyncJobTheWholeSave) {
  TempDir dir;
  write_this_cpu_catalog(dir / "cpu.toml");
  const std::string catalog = "plan.catalog=" + (dir / "cpu.toml").string();
  const Config async_job = stall_config({catalog});
  // The pilot as kiln pilot writes it (pilot.json), read back as the plan reads it.
  write_text(dir / "pilot.json",
             nlohmann::json{{"job_hash", job_hash(async_job)},
                            {"device_name", "cpu"},
                            {"step_seconds", 0.01},
                            {"eval_seconds", 1e-3},
                            {"matmul_peak", {{"flops_per_second", 2e9}}},
                            {"checkpoint",
                             {{"write_bytes_per_second", 1e8},
                              {"async", true},
                              {"save_blocking_seconds", 5e-4},
                              {"save_end_wait_seconds", 2.5e-4}}},
                            {"step_timing", {{"method", "the median of steps 3-6"}}}}
                 .dump());
  const PilotCalibration pilot = read_pilot(dir.path(), async_job);
  EXPECT_DOUBLE_EQ(pilot.save_blocking_seconds, 5e-4);
  EXPECT_DOUBLE_EQ(pilot.save_end_wait_seconds, 2.5e-4);
  const Forecast f = forecast_run(async_job, &pilot, "cpu", 1);
  EXPECT_NEAR(f.step_seconds, 0.01, 1e-15);
  EXPECT_THAT(f.mfu_source, HasSubstr("the median of steps 3-6"));
  EXPECT_TRUE(f.async_save);
  EXPECT_NEAR(f.save_seconds, 4.27008e-3, 1e-15);
  // Each save: the blocking part and the wait that finished it after an evaluation (the save at
  // the last step ends so, before the final evaluation's end: nothing more is exposed).
  EXPECT_DOUBLE_EQ(f.save_stall_seconds, 7.5e-4);
  EXPECT_THAT(f.save_stall_source,
              HasSubstr("blocking part of an async save and the wait that finished it"));
  EXPECT_NEAR(f.checkpoint_seconds, 3e-3, 1e-15);
  EXPECT_NEAR(f.wall_seconds, 2.005, 1e-12);
  EXPECT_NEAR(f.ettr, 2.0 / 2.005, 1e-12);
  // kiln plan --actual: the run's time in its checkpoint phase against it (the last row).
  ActualRun a;
  a.checkpoint_seconds = 3e-3 / 1.05;
  const nlohmann::json c = compare_forecast(f, a);
  ASSERT_EQ(c["rows"].size(), 9u);
  EXPECT_EQ(c["rows"][8]["quantity"], "time lost to checkpoints");
  EXPECT_NEAR(c["rows"][8]["ratio"].get<double>(), 1.05, 1e-12);
  // No save at the last step (210 steps, no final save): the four saves' stalls alone.
  const Config no_final = stall_config({catalog, "train.steps=210", "checkpoint.save_final=false"});
  EXPECT_NEAR(forecast_run(no_final, &pilot, "cpu", 1).checkpoint_seconds, 3e-3, 1e-15);
  // A final save after the final evaluation (210 steps, save_final): five stalls, and the rest
  // of the last one's write, which no evaluation covers.
  const Config final_after_eval = stall_config({catalog, "train.steps=210"});
  EXPECT_NEAR(forecast_run(final_after_eval, &pilot, "cpu", 1).checkpoint_seconds,
              5 * 7.5e-4 + (4.27008e-3 - 7.5e-4), 1e-15);
  // A pilot that measured the blocking part but no end wait (an older kiln): the blocking part.
  PilotCalibration no_end_wait = pilot;
  no_end_wait.save_end_wait_seconds = 0;
  const Forecast blocking_only = forecast_run(async_job, &no_end_wait, "cpu", 1);
  EXPECT_DOUBLE_EQ(blocking_only.save_stall_seconds, 5e-4);
  EXPECT_EQ(blocking_only.save_stall_source,
            "the blocking part of an async save, measured by the pilot");
  // Synchronous saves, or a pilot that measured no blocking part: the whole save each.
  const Config sync_job = stall_config({catalog, "checkpoint.async=false"});
  const Forecast sync = forecast_run(sync_job, &pilot, "cpu", 1);
  EXPECT_NEAR(sync.save_stall_seconds, 4.27008e-3, 1e-15);
  EXPECT_NEAR(sync.checkpoint_seconds, 1.708032e-2, 1e-15);
  EXPECT_THAT(sync.save_stall_source, HasSubstr("checkpoint.async = false"));
  PilotCalibration older = pilot;
  older.save_blocking_seconds = 0;
  EXPECT_NEAR(forecast_run(async_job, &older, "cpu", 1).checkpoint_seconds, 1.708032e-2, 1e-15);

  // The plan's delta on the pilot's row: the stall, in Tc = delta + sqrt(2 (M + R) delta +
  // delta^2); the whole save with synchronous saves.
  for (const auto& [config, delta] :
       {std::pair{async_job, 7.5e-4}, std::pair{sync_job, 4.27008e-3}}) {
    const PlanResult plan = make_plan(config, &pilot, false);
    ASSERT_EQ(plan.rows.size(), 1u);
    const PlanRow& row = plan.rows[0];
    ASSERT_EQ(row.hardware, "this-cpu");
    EXPECT_NEAR(row.save_seconds, delta, 1e-15);
    EXPECT_NEAR(row.full_save_seconds, 4.27008e-3, 1e-15);
    EXPECT_NEAR(row.checkpoint_interval_seconds,
                recovery_aware_interval_seconds(delta, row.job_mtbf_seconds, row.restart_seconds),
                1e-9);
  }
}

}  // namespace
}  // namespace kiln::testing
