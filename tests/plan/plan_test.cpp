// The plan component: the analytic model against built models, the known answers, the catalog,
// the budget and the bad-input errors (docs/plan.md).
#include "kiln/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "kiln/error.h"
#include "kiln/models.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

Config config_with(const std::vector<std::string>& overrides) {
  Config config = Config::defaults();
  for (const auto& o : overrides) config.set_from_string(o);
  config.validate();
  return config;
}

Config gpt_6_7b() {
  return Config::load(source_dir() / "configs" / "gpt-6.7b.toml");
}

TEST(PlanModel, AnalyticParameterCountEqualsBuiltModels) {
  const std::vector<std::vector<std::string>> cases = {
      {"model.name=gpt", "data.name=text", "model.preset=tiny"},
      {"model.name=gpt", "data.name=text", "model.preset=small"},
      {"model.name=gpt", "data.name=text", "model.preset=tiny", "model.n_layer=3",
       "model.n_embd=96", "model.n_head=3", "model.vocab_size=300", "model.block_size=64",
       "data.seq_len=64"},
      {"model.name=mlp"},
      {"model.name=mlp", "model.input_dim=7", "model.hidden_dim=33", "model.num_classes=5"},
  };
  for (const auto& overrides : cases) {
    const Config config = config_with(overrides);
    EXPECT_EQ(analytic_parameter_count(model_shape(config)), parameter_count(*make_model(config)))
        << config.to_toml(false);
  }
}

TEST(PlanModel, FlopsPerTokenMatchTheModel) {
  const Config config = config_with({"model.name=gpt", "data.name=text", "model.preset=small"});
  const auto model = make_model(config);
  const int64_t seq = config.get_int("data.seq_len");
  EXPECT_DOUBLE_EQ(train_flops_per_token(model_shape(config), seq) * static_cast<double>(seq),
                   model->train_flops_per_sample(seq));
  // Activation checkpointing adds one forward: 8/6 of the work.
  EXPECT_DOUBLE_EQ(train_flops_per_token(model_shape(config), seq, true),
                   train_flops_per_token(model_shape(config), seq) * 4.0 / 3.0);
}

TEST(PlanModel, StateBytesPerParameter) {
  JobShape job;
  EXPECT_EQ(state_bytes_per_parameter(job), 16);  // fp32 AdamW: 4 + 4 + 8
  job.precision = "bf16";
  EXPECT_EQ(state_bytes_per_parameter(job), 16);  // fp32 master state: the saving is activations
  job.optimizer = "sgd";
  EXPECT_EQ(state_bytes_per_parameter(job), 8);
  job.momentum = true;
  EXPECT_EQ(state_bytes_per_parameter(job), 12);
}

// The known answer: ~6.7B parameters, 16 B/param ~ 107 GB of fp32 AdamW state.
TEST(PlanKnownAnswers, SixPointSevenBillionOnEightyGigabyteDevices) {
  const Config config = gpt_6_7b();
  const ModelShape shape = model_shape(config);
  const double n = static_cast<double>(analytic_parameter_count(shape));
  EXPECT_NEAR(n, 6.6e9, 0.15e9);
  const JobShape job = job_shape(config);
  const double state = n * state_bytes_per_parameter(job);
  EXPECT_NEAR(state / 1e9, 107, 3);

  const auto catalog = load_catalog();
  const Device& h100 = find_device(catalog, "h100-sxm", "test");
  const Device& a100 = find_device(catalog, "a100-80gb-sxm", "test");
  for (const Device* device : {&h100, &a100}) {
    for (int64_t gpus : {1, 2, 4, 8, 16, 64}) {
      JobShape at = job;
      at.world_size = gpus;
      const StrategyDecision d =
          choose_strategy(strategy_input(shape, at, device->memory_bytes, 0.1));
      EXPECT_NE(d.strategy, "ddp") << device->name << " x" << gpus;  // never at any count
      EXPECT_GT(d.ddp_bytes_per_device, device->memory_bytes);
    }
  }
  JobShape eight = job;
  eight.world_size = 8;
  const StrategyInput in = strategy_input(shape, eight, h100.memory_bytes, 0.1);
  const StrategyDecision d = choose_strategy(in);
  EXPECT_EQ(d.strategy, "fsdp");
  EXPECT_NEAR(in.ddp_model_state_bytes / 8 / 1e9, 13.4, 0.5);  // model state per GPU
  EXPECT_THAT(d.reason, HasSubstr("fsdp over"));

  const Device& mi300x = find_device(catalog, "MI300X", "test");
  EXPECT_EQ(mi300x.memory_bytes, 192e9);
  JobShape one = job;
  one.world_size = 1;
  const StrategyInput mi = strategy_input(shape, one, mi300x.memory_bytes, 0.1);
  EXPECT_LT(mi.ddp_model_state_bytes, mi300x.memory_bytes * 0.9);  // DDP's model state fits
  EXPECT_EQ(choose_strategy(mi).strategy, "ddp");
}

// Young: delta = 60 s, M = 3.1 h -> sqrt(2 * 60 * 11160) = 1157 s, about 19 minutes.
TEST(PlanKnownAnswers, YoungInterval) {
  const double tau = young_interval_seconds(60, 3.1 * 3600);
  EXPECT_NEAR(tau / 60, 19.3, 0.1);
  EXPECT_EQ(young_interval_seconds(60, 0), 0);
}

TEST(PlanBudget, WholeProcess) {
  BudgetInput in;
  in.steps = 1000;
  in.compute_seconds_per_step = 0.9;
  in.communication_seconds_per_step = 0.1;
  in.evals = 10;
  in.eval_seconds = 30;
  in.save_seconds = 60;
  in.restart_seconds = 600;
  in.gpus = 16384;
  in.gpu_mtbf_hours = 3.1 * 16384;  // M = 3.1 h for the job
  in.restore_drills = 1;
  in.pilot_seconds = 3600;
  in.margin_fraction = 0.1;
  const Budget b = budget(in);
  EXPECT_DOUBLE_EQ(b.step_seconds, 1.0);
  EXPECT_DOUBLE_EQ(b.train_seconds, 1000);
  EXPECT_DOUBLE_EQ(b.eval_seconds, 300);
  EXPECT_NEAR(b.job_mtbf_seconds, 3.1 * 3600, 1e-6);
  const double tau = std::sqrt(2 * 60 * 3.1 * 3600);
  EXPECT_NEAR(b.checkpoint_interval_seconds, tau, 1e-6);
  EXPECT_NEAR(b.saves_seconds, 1300 / tau * 60, 1e-6);
  const double run = (1300 + b.saves_seconds) / (1 - (tau / 2 + 600) / (3.1 * 3600));
  EXPECT_NEAR(b.expected_failures, run / (3.1 * 3600), 1e-9);
  EXPECT_NEAR(b.lost_seconds, run - 1300 - b.saves_seconds, 1e-6);
  EXPECT_DOUBLE_EQ(b.drills_seconds, 660);
  EXPECT_NEAR(b.wall_seconds, 1.1 * (run + 660 + 3600), 1e-6);
  EXPECT_NEAR(b.ettr, 1000 / b.wall_seconds, 1e-12);
  // Failures faster than progress: never finishes.
  in.gpu_mtbf_hours = 0.1;
  EXPECT_FALSE(std::isfinite(budget(in).wall_seconds));
  // No failure model: no saves for it, no losses.
  in.gpu_mtbf_hours = 0;
  const Budget quiet = budget(in);
  EXPECT_EQ(quiet.saves_seconds, 0);
  EXPECT_EQ(quiet.expected_failures, 0);
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
  const auto plan = make_plan(config, nullptr, /*require_cost=*/false);
  ASSERT_EQ(plan["rows"].size(), load_catalog().size());
  for (const auto& row : plan["rows"]) {
    const std::string name = row["hardware"];
    const std::string strategy = row["strategy"]["strategy"];
    if (name == "mi300x" || name == "b200") {
      EXPECT_EQ(strategy, "ddp") << name;
    } else if (name == "h200-sxm") {
      EXPECT_NE(strategy, "does-not-fit");
    } else {
      EXPECT_EQ(strategy, "fsdp") << name;
    }
    EXPECT_GT(row["wall_seconds"].get<double>(), row["train_seconds"].get<double>());
    EXPECT_GT(row["ettr"].get<double>(), 0);
    EXPECT_LT(row["ettr"].get<double>(), 1);
    EXPECT_TRUE(row["reservation_7d"]["cost"].is_null());
  }
  EXPECT_FALSE(plan["assumptions"].empty());
  EXPECT_THAT(plan_markdown(plan), HasSubstr("| h100-sxm |"));
}

// train.precision = "bf16-mixed" computes in bf16: each row's compute time uses its bf16 peak
// (the same FLOPs over a larger peak), and activations are 2 bytes, so memory per device shrinks.
TEST(Plan, MixedPrecisionUsesTheHalfPrecisionPeak) {
  Config fp32 = gpt_6_7b();
  Config bf16 = gpt_6_7b();
  bf16.set_from_string("train.precision=bf16-mixed");
  const auto a = make_plan(fp32, nullptr, /*require_cost=*/false);
  const auto b = make_plan(bf16, nullptr, /*require_cost=*/false);
  ASSERT_EQ(a["rows"].size(), b["rows"].size());
  const auto catalog = load_catalog();
  for (size_t k = 0; k < a["rows"].size(); ++k) {
    const auto& ra = a["rows"][k];
    const auto& rb = b["rows"][k];
    const Device& d = find_device(catalog, ra["hardware"].get<std::string>(), "k");
    EXPECT_EQ(rb["peak_flops_per_gpu"].get<double>(), d.peak_flops_for("bf16")) << d.name;
    EXPECT_EQ(d.peak_flops_for("bf16-mixed"), d.peak_flops_for("bf16"));
    EXPECT_NEAR(
        ra["compute_seconds_per_step"].get<double>() / rb["compute_seconds_per_step"].get<double>(),
        d.peak_flops_for("bf16") / d.peak_flops_for("fp32"), 1e-9)
        << d.name;
    EXPECT_LT(rb["strategy"]["ddp_bytes_per_device"].get<double>(),
              ra["strategy"]["ddp_bytes_per_device"].get<double>())
        << d.name;
  }
  EXPECT_EQ(compute_precision("FP16-mixed"), "fp16");
  EXPECT_EQ(compute_precision("tf32"), "tf32");
}

TEST(Plan, CostsTheCheapestRowThatFits) {
  Config config = gpt_6_7b();
  config.set_from_string("plan.hardware=h100-sxm, mi300x");
  config.set_from_string("plan.tokens=2e9");
  config.set_from_string("plan.price_7d_per_gpu_hour={ h100-sxm = 3.0, mi300x = 2.0 }");
  config.set_from_string("plan.price_30d_per_gpu_hour={ h100-sxm = 2.0, mi300x = 1.5 }");
  const auto plan = make_plan(config, nullptr, /*require_cost=*/true);
  ASSERT_EQ(plan["rows"].size(), 2u);
  const auto& h100 = plan["rows"][0];
  EXPECT_DOUBLE_EQ(h100["reservation_7d"]["cost"].get<double>(), 8 * 7 * 24 * 3.0);
  EXPECT_DOUBLE_EQ(h100["reservation_30d"]["cost"].get<double>(), 8 * 30 * 24 * 2.0);
  // The cheapest (row, reservation) that fits.
  double cheapest = 1e300;
  std::string name;
  int days = 0;
  for (const auto& row : plan["rows"]) {
    for (int d : {7, 30}) {
      const auto& r = row[d == 7 ? "reservation_7d" : "reservation_30d"];
      if (r["fits"].get<bool>() && r["cost"].get<double>() < cheapest) {
        cheapest = r["cost"].get<double>();
        name = row["hardware"];
        days = d;
      }
    }
  }
  ASSERT_FALSE(name.empty());
  EXPECT_EQ(plan["recommendation"]["hardware"], name);
  EXPECT_EQ(plan["recommendation"]["reservation_days"], days);
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

TEST(Plan, CliPlansWithoutBuildingTheModel) {
  TempDir dir;
  // 70B-class shape: building it would need ~280 GB; planning takes no memory to speak of.
  auto plan = run_kiln("plan " + (source_dir() / "configs" / "gpt-6.7b.toml").string() +
                       " --set run.dir=" + dir.path().string() +
                       " --set model.n_layer=80 --set model.n_embd=8192 --set model.n_head=64");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_THAT(plan.out, HasSubstr("| h100-sxm |"));
  EXPECT_THAT(plan.out, HasSubstr("Recommendation:"));
  auto j = nlohmann::json::parse(slurp(dir / "gpt-6.7b" / "plan.json"));
  EXPECT_GT(j["model"]["parameters"].get<double>(), 60e9);
  auto unknown = run_kiln("plan " + (source_dir() / "configs" / "gpt-6.7b.toml").string() +
                          " --set run.dir=" + dir.path().string() + " --set plan.hardware=h10");
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("did you mean"));
}

}  // namespace
}  // namespace kiln::testing
