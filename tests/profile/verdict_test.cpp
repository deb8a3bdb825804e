// The profile rung's decision: trace analysis on hand-made traces (self times, phases, memory,
// Holistic Trace Analysis's GPU breakdown) and the verdict on analyses and on real profiled runs
// (data-, host- and compute-bound). profile_test.cpp has the schedule, the profiler and the ladder.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>

#include "kiln/error.h"
#include "kiln/profile.h"
#include "kiln/rungs.h"
#include "kiln/session.h"
#include "profile/trace_io.h"
#include "support/compose.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

// ---- analysis on hand-made traces ---------------------------------------------------------------

json x_event(const std::string& cat, const std::string& name, double ts, double dur, int tid = 1,
             json args = json::object()) {
  return {{"ph", "X"},  {"cat", cat}, {"name", name}, {"pid", 7},
          {"tid", tid}, {"ts", ts},   {"dur", dur},   {"args", args}};
}

json memory_event(double ts, double total, double bytes, int tid = 1) {
  return {{"ph", "i"},
          {"cat", "cpu_instant_event"},
          {"name", "[memory]"},
          {"pid", 7},
          {"tid", tid},
          {"ts", ts},
          {"args",
           {{"Total Allocated", total}, {"Bytes", bytes}, {"Device Type", 0}, {"Device Id", -1}}}};
}

TEST(TraceAnalysis, SelfTimesPhasesAndMemoryFromAHandMadeTrace) {
  // One 100 us step: data_wait 10, forward 40 (linear 30 > addmm 20), backward 30, optimizer 10,
  // 10 us outside any phase; a loader thread runs aten::stack for 5 us.
  json events = json::array({
      x_event("user_annotation", "ProfilerStep#0", 0, 100),
      x_event("user_annotation", "data_wait", 0, 10),
      x_event("user_annotation", "forward", 10, 40),
      x_event("cpu_op", "aten::linear", 12, 30, 1,
              {{"Input Dims", json::parse("[[8, 4], [16, 4], [16]]")}, {"External id", 1}}),
      x_event("cpu_op", "aten::addmm", 15, 20, 1,
              {{"Input Dims", json::parse("[[16], [8, 4], [4, 16]]")},
               {"External id", 2},
               {"flops", 1024}}),
      x_event("user_annotation", "backward", 50, 30),
      x_event("cpu_op", "aten::mm", 52, 25),
      x_event("user_annotation", "optimizer", 80, 10),
      x_event("cpu_op", "aten::_fused_adamw_", 81, 8),
      x_event("cpu_op", "aten::stack", 3, 5, /*tid=*/2),
      memory_event(16, 1000, 1000),
      memory_event(53, 5000, 4000),
      memory_event(54, 3000, -2000),
      memory_event(82, 3500, 500),
  });
  const TraceAnalysis a = analyze_traces({json{{"traceEvents", events}}});
  EXPECT_EQ(a.steps, 1);
  EXPECT_DOUBLE_EQ(a.step_seconds, 100e-6);
  ASSERT_EQ(a.operators.size(), 5u);
  EXPECT_EQ(a.operators[0].name, "aten::mm");
  EXPECT_DOUBLE_EQ(a.operators[0].self_cpu_us, 25);
  auto op = [&](const std::string& name) {
    for (const auto& o : a.operators) {
      if (o.name == name) return o;
    }
    return OperatorStats{};
  };
  EXPECT_DOUBLE_EQ(op("aten::linear").self_cpu_us, 10);  // 30 minus the nested addmm
  EXPECT_DOUBLE_EQ(op("aten::linear").total_cpu_us, 30);
  EXPECT_DOUBLE_EQ(op("aten::addmm").flops, 1024);
  ASSERT_EQ(op("aten::addmm").input_shapes.size(), 1u);
  EXPECT_EQ(op("aten::addmm").input_shapes[0].first, "[[16],[8,4],[4,16]]");
  EXPECT_EQ(op("aten::stack").calls, 1);  // other threads count in the operator table
  // Training thread inside the step: linear, addmm, mm, adamw (not the loader's stack).
  EXPECT_EQ(a.step_ops, 4);
  EXPECT_DOUBLE_EQ(a.step_op_self_us, 10 + 20 + 25 + 8);
  EXPECT_DOUBLE_EQ(a.mean_op_us, 63.0 / 4);
  std::map<std::string, double> share;
  for (const auto& p : a.phases) share[p.phase] = p.share;
  EXPECT_DOUBLE_EQ(share["data_wait"], 0.10);
  EXPECT_DOUBLE_EQ(share["forward"], 0.40);
  EXPECT_DOUBLE_EQ(share["backward"], 0.30);
  EXPECT_DOUBLE_EQ(share["optimizer"], 0.10);
  EXPECT_NEAR(share["other"], 0.10, 1e-12);
  std::map<std::string, PhaseMemory> memory;
  for (const auto& m : a.memory) memory[m.phase] = m;
  EXPECT_DOUBLE_EQ(memory["forward"].peak_allocated_bytes, 1000);
  EXPECT_DOUBLE_EQ(memory["backward"].peak_allocated_bytes, 5000);
  EXPECT_DOUBLE_EQ(memory["backward"].growth_bytes, 4000);  // from 1000 before the phase
  EXPECT_DOUBLE_EQ(memory["optimizer"].peak_allocated_bytes, 3500);
  EXPECT_DOUBLE_EQ(memory["optimizer"].growth_bytes, 500);
  EXPECT_FALSE(a.has_gpu);
}

TEST(TraceAnalysis, GpuTemporalAndIdleBreakdownFollowHolisticTraceAnalysis) {
  // Stream 7: k1 [0,10); k2 [10.01,20) launched at 5, before k1 ended: a 0.01 us kernel wait;
  // k3 [30,40) launched at 25, after k2 ended: 10 us host wait; k4 [45,50) launched at 35:
  // 5 us other. Stream 8: an NCCL all-reduce [40,60), overlapped by k4 for 5 us.
  auto kernel = [](const std::string& name, double ts, double dur, int stream, int correlation,
                   int external) {
    return json{
        {"ph", "X"},
        {"cat", "kernel"},
        {"name", name},
        {"pid", 0},
        {"tid", stream},
        {"ts", ts},
        {"dur", dur},
        {"args", {{"stream", stream}, {"correlation", correlation}, {"External id", external}}}};
  };
  auto launch = [](double ts, int correlation) {
    return json{{"ph", "X"},
                {"cat", "cuda_runtime"},
                {"name", "cudaLaunchKernel"},
                {"pid", 7},
                {"tid", 1},
                {"ts", ts},
                {"dur", 1},
                {"args", {{"correlation", correlation}}}};
  };
  json events = json::array({
      x_event("user_annotation", "ProfilerStep#0", 0, 70),
      x_event("cpu_op", "aten::mm", 0, 60, 1, {{"External id", 100}}),
      launch(0, 1),
      launch(5, 2),
      launch(25, 3),
      launch(35, 4),
      launch(36, 5),
      kernel("gemm_kernel", 0, 10, 7, 1, 100),
      kernel("gemm_kernel", 10.01, 9.99, 7, 2, 100),
      kernel("elementwise_kernel", 30, 10, 7, 3, 100),
      kernel("ncclDevKernel_AllReduce", 40, 20, 8, 5, 100),
      kernel("elementwise_kernel", 45, 5, 7, 4, 100),
  });
  const TraceAnalysis a = analyze_traces({json{{"traceEvents", events}}});
  ASSERT_TRUE(a.has_gpu);
  const auto& g = a.gpu;
  EXPECT_EQ(g.kernels, 5);
  EXPECT_DOUBLE_EQ(g.kernel_us, 60);    // 0 .. 60
  EXPECT_NEAR(g.idle_us, 10.01, 1e-9);  // [10,10.01) and [20,30)
  EXPECT_NEAR(g.compute_us, 10 + 9.99 + 10 + 5, 1e-9);
  EXPECT_DOUBLE_EQ(g.communication_us, 20);
  EXPECT_NEAR(g.non_compute_us, 60 - 34.99 - 10.01, 1e-9);  // the comm not covered by compute
  EXPECT_NEAR(g.kernel_wait_us, 0.01, 1e-9);
  EXPECT_NEAR(g.host_wait_us, 10, 1e-9);
  EXPECT_NEAR(g.other_wait_us, 5, 1e-9);  // stream 7: [40,45) with the launch at 35
  EXPECT_NEAR(g.comm_overlap_share, 5.0 / 20, 1e-12);
  EXPECT_TRUE(a.device_sorted);
  EXPECT_NEAR(a.operators[0].self_device_us, 10 + 9.99 + 10 + 20 + 5, 1e-9);
}

TEST(TraceAnalysis, ForeignEventsWithMissingOrMistypedFieldsAreSkippedNotFatal) {
  // torch.profiler traces from other versions and tools: [memory] events without args or with
  // args of another type, kernels and launches without args, names and categories that are not
  // strings. None of it may crash (or be undefined behaviour); the well-formed events still count.
  json events = json::array({
      x_event("user_annotation", "ProfilerStep#0", 0, 100),
      x_event("user_annotation", "forward", 10, 40),
      x_event("cpu_op", "aten::mm", 12, 30),
      json{{"ph", "i"}, {"name", "[memory]"}, {"pid", 7}, {"tid", 1}, {"ts", 20}},  // no args
      json{{"ph", "i"}, {"name", "[memory]"}, {"ts", 21}, {"args", "not an object"}},
      json{{"ph", "i"}, {"name", "[memory]"}, {"ts", 22}, {"args", {{"Total Allocated", "x"}}}},
      memory_event(23, 2048, 2048),
      json{{"ph", "X"}, {"cat", 5}, {"name", "aten::weird"}, {"ts", 30}, {"dur", 1}},
      json{{"ph", "X"}, {"cat", "cpu_op"}, {"name", json::array({1})}, {"ts", 31}, {"dur", "1"}},
      json{{"ph", "X"},
           {"cat", "cpu_op"},
           {"name", "aten::add"},
           {"ts", 45},
           {"dur", 2},
           {"args", json::array({1, 2})}},
      json{{"ph", "X"}, {"cat", "cuda_runtime"}, {"name", "cudaLaunchKernel"}, {"ts", 50}},
      json{{"ph", "X"}, {"cat", "cuda_runtime"}, {"ts", 51}, {"args", {{"correlation", "7"}}}},
      json{{"ph", "X"}, {"cat", "kernel"}, {"name", "gemm"}, {"ts", 60}, {"dur", 5}},
      json{{"ph", "X"}, {"cat", "kernel"}, {"ts", 70}, {"dur", 5}, {"args", nullptr}},
      json{{"ph", 1}, {"cat", "kernel"}},
      json("not an event"),
  });
  TraceAnalysis a;
  ASSERT_NO_THROW(a = analyze_traces({json{{"traceEvents", events}, {"deviceProperties", 3}}}));
  EXPECT_EQ(a.steps, 1);
  EXPECT_TRUE(a.has_gpu);
  EXPECT_EQ(a.gpu.kernels, 2);
  std::map<std::string, PhaseMemory> memory;
  for (const auto& m : a.memory) memory[m.phase] = m;
  ASSERT_EQ(memory.count("forward"), 1u);
  EXPECT_DOUBLE_EQ(memory["forward"].peak_allocated_bytes, 2048);  // only the well-formed event
  std::set<std::string> names;
  for (const auto& op : a.operators) names.insert(op.name);
  EXPECT_TRUE(names.count("aten::mm"));
  EXPECT_TRUE(names.count("aten::add"));     // args of the wrong type: no shapes, still counted
  EXPECT_FALSE(names.count("aten::weird"));  // not a cpu_op
  // The verdict runs on what could be read.
  EXPECT_NO_THROW(decide_bottleneck(a, VerdictThresholds{}, VerdictContext{}));
}

// ---- verdicts -----------------------------------------------------------------------------------

TraceAnalysis analysis_with(double data_wait_share, double comm_share, double mean_op_us) {
  TraceAnalysis a;
  a.steps = 10;
  a.step_seconds = 1.0;
  a.phases = {{"data_wait", data_wait_share, data_wait_share}, {"comm", comm_share, comm_share}};
  a.mean_op_us = mean_op_us;
  a.step_ops = 100;
  OperatorStats mm;
  mm.name = "aten::mm";
  mm.calls = 10;
  mm.self_cpu_us = 500;
  a.operators = {mm};
  return a;
}

TEST(Verdict, EachBottleneckWithTheNumbersThatDecidedIt) {
  VerdictThresholds t;
  VerdictContext c{.num_workers = 2, .prefetch = 4, .batch_size = 32, .grad_accum_steps = 1};
  Verdict v = decide_bottleneck(analysis_with(0.40, 0.30, 5), t, c);
  EXPECT_EQ(v.bottleneck, "data-bound");  // data first, even when comm and host also trip
  EXPECT_THAT(v.reason, HasSubstr("40.0%"));
  EXPECT_THAT(v.actions[0], HasSubstr("data.num_workers (now 2)"));
  EXPECT_DOUBLE_EQ(v.numbers["data_wait_share"].get<double>(), 0.40);

  // Traces analysed without their config: no "(now N)" in the actions.
  for (const auto& action :
       decide_bottleneck(analysis_with(0.40, 0.0, 5), t, VerdictContext{}).actions) {
    EXPECT_THAT(action, ::testing::Not(HasSubstr("(now")));
  }

  v = decide_bottleneck(analysis_with(0.05, 0.30, 500), t, c);
  EXPECT_EQ(v.bottleneck, "communication-bound");
  EXPECT_THAT(v.reason, HasSubstr("30.0%"));
  EXPECT_THAT(v.actions[0], HasSubstr("bucket size"));

  TraceAnalysis full = analysis_with(0.05, 0.0, 500);
  full.memory = {{"backward", "cpu", 95e9, 10e9}};
  c.device_memory_bytes = 100e9;
  v = decide_bottleneck(full, t, c);
  EXPECT_EQ(v.bottleneck, "memory-bound");
  EXPECT_DOUBLE_EQ(v.numbers["memory_fraction"].get<double>(), 0.95);
  EXPECT_THAT(v.actions[0], HasSubstr("train.grad_accum_steps (now 1)"));
  EXPECT_THAT(v.actions, ::testing::Contains(HasSubstr("activation checkpointing")));

  v = decide_bottleneck(analysis_with(0.05, 0.0, 5), t, c);
  EXPECT_EQ(v.bottleneck, "host-bound");
  EXPECT_THAT(v.reason, HasSubstr("5.0 us"));
  EXPECT_THAT(v.actions[0], HasSubstr("train.batch_size (now 32)"));

  v = decide_bottleneck(analysis_with(0.05, 0.0, 500), t, c);
  EXPECT_EQ(v.bottleneck, "compute-bound");
  EXPECT_THAT(v.reason, HasSubstr("aten::mm"));

  // CUDA: an idle GPU waiting on the host is launch-bound; a busy one compute-bound.
  TraceAnalysis gpu = analysis_with(0.0, 0.0, 5);
  gpu.has_gpu = true;
  gpu.gpu = {
      .kernel_us = 100, .compute_us = 50, .idle_us = 50, .host_wait_us = 40, .other_wait_us = 10};
  c.cuda = true;
  EXPECT_EQ(decide_bottleneck(gpu, t, c).bottleneck, "host-bound");
  gpu.gpu = {.kernel_us = 100, .compute_us = 95, .idle_us = 5, .host_wait_us = 5};
  EXPECT_EQ(decide_bottleneck(gpu, t, c).bottleneck, "compute-bound");
  gpu.gpu = {.kernel_us = 100,
             .compute_us = 60,
             .non_compute_us = 40,
             .communication_us = 40,
             .comm_overlap_share = 0.25};
  v = decide_bottleneck(gpu, t, c);
  EXPECT_EQ(v.bottleneck, "communication-bound");  // 30 of 40 us exposed = 30% of kernel time
  EXPECT_NEAR(v.numbers["exposed_comm_kernel_share"].get<double>(), 0.30, 1e-12);
}

TEST(Verdict, ActionsNameTheKeyThatDoesIt) {
  // An action suggesting FSDP, activation checkpointing, a CUDA graph or mixed precision names
  // the config key that turns it on (kiln has each of them); none says "not in kiln yet". An
  // action suggesting a compiled step points at the compile rung.
  VerdictThresholds t;
  TraceAnalysis full = analysis_with(0.05, 0.0, 500);
  full.memory = {{"backward", "cpu", 95e9, 10e9}};
  std::vector<Verdict> verdicts = {
      decide_bottleneck(analysis_with(0.40, 0.0, 5), t, {}),
      decide_bottleneck(analysis_with(0.05, 0.30, 500), t, {}),
      decide_bottleneck(full, t, VerdictContext{.device_memory_bytes = 100e9}),
      decide_bottleneck(analysis_with(0.05, 0.0, 5), t, {}),
      decide_bottleneck(analysis_with(0.05, 0.0, 5), t, VerdictContext{.cuda = true}),
      decide_bottleneck(analysis_with(0.05, 0.0, 500), t, {}),
      decide_bottleneck(analysis_with(0.05, 0.0, 500), t, VerdictContext{.cuda = true})};
  std::set<std::string> bottlenecks;
  int compile_actions = 0;
  int named_keys = 0;
  for (const auto& v : verdicts) {
    bottlenecks.insert(v.bottleneck);
    for (const auto& action : v.actions) {
      EXPECT_THAT(action, ::testing::Not(HasSubstr("(scale rung)"))) << v.bottleneck;
      if (action.find("compiled step") != std::string::npos ||
          action.find("fuse the") != std::string::npos ||
          action.find("fuse small") != std::string::npos) {
        EXPECT_THAT(action, HasSubstr("the compile rung: kiln compile")) << v.bottleneck;
        ++compile_actions;
      }
      EXPECT_THAT(action, ::testing::Not(HasSubstr("not in kiln"))) << v.bottleneck;
      const std::pair<const char*, const char*> keys[] = {
          {"FSDP", "dist.strategy = \"fsdp\""},
          {"checkpointing", "train.activation_checkpointing = \"block\""},
          {"CUDA graph", "compile.backend = \"inductor+cudagraphs\""},
          {"bf16", "train.precision = \"bf16-mixed\""}};
      for (const auto& [feature, key] : keys) {
        if (action.find(feature) != std::string::npos) {
          EXPECT_THAT(action, HasSubstr(key)) << v.bottleneck;
          ++named_keys;
        }
      }
    }
  }
  EXPECT_EQ(bottlenecks.size(), 5u);  // every verdict's actions were checked
  EXPECT_GE(compile_actions, 2);      // host-bound and compute-bound point at the compile rung
  EXPECT_GE(named_keys, 5);  // memory-bound: 3; CUDA host-bound: a graph; CUDA compute: bf16
}

// A dataset whose batches take `delay` to build: a loader that cannot keep up.
class SlowDataset final : public Dataset {
 public:
  SlowDataset(std::shared_ptr<const Dataset> inner, std::chrono::milliseconds delay)
      : inner_(std::move(inner)), delay_(delay) {}
  int64_t size() const override { return inner_->size(); }
  int64_t tokens_per_sample() const override { return inner_->tokens_per_sample(); }
  Batch get(const std::vector<int64_t>& indices) const override {
    std::this_thread::sleep_for(delay_);
    return inner_->get(indices);
  }

 private:
  std::shared_ptr<const Dataset> inner_;
  std::chrono::milliseconds delay_;
};

// Trains `steps` steps under the profiler and returns the verdict on its traces.
Verdict profiled_verdict(const Config& config, Datasets data, int64_t steps) {
  apply_runtime_settings(config);
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), std::move(data));
  install_configured_checkpointing(trainer);
  TempDir traces;
  auto profiler =
      std::make_shared<Profiler>(profiler_options(config, traces.path(), torch::kCPU, 0, 1));
  trainer.add_hook(profiler);
  for (int64_t k = 0; k < steps; ++k) trainer.train_step();
  profiler->finish(trainer);
  std::vector<json> windows;
  for (const auto& path : profiler->traces()) windows.push_back(read_trace(path));
  VerdictContext context{.num_workers = static_cast<int>(config.get_int("data.num_workers")),
                         .batch_size = config.get_int("train.batch_size")};
  return decide_bottleneck(analyze_traces(windows), VerdictThresholds::from_config(config),
                           context);
}

const std::vector<std::string> kShortSchedule = {"profile.skip_first=2", "profile.wait=0",
                                                 "profile.warmup=1",     "profile.active=5",
                                                 "profile.repeat=1",     "run.threads=1"};
constexpr int64_t kShortScheduleSteps = 2 + 1 + 5;

TEST(Verdict, ASlowDatasetIsDataBound) {
  TempDir dir;
  auto overrides = kShortSchedule;
  overrides.push_back("data.num_workers=0");
  Config config = mlp_config(dir.path(), overrides);
  Datasets data = make_datasets(config);
  data.train = std::make_shared<SlowDataset>(data.train, std::chrono::milliseconds(20));
  const Verdict v = profiled_verdict(config, std::move(data), kShortScheduleSteps);
  EXPECT_EQ(v.bottleneck, "data-bound") << v.reason;
  // 20 ms of sleep per batch against a few milliseconds of math per step: the share stays far
  // above the threshold even when a loaded machine slows the math tenfold.
  EXPECT_GE(v.numbers["data_wait_share"].get<double>(),
            v.numbers["thresholds"]["data_bound_share"].get<double>());
}

TEST(Verdict, ATinyModelWithTinyBatchesIsHostBound) {
  TempDir dir;
  auto overrides = kShortSchedule;
  // Batches built in the training thread: a worker's wake-up latency on a busy machine would
  // add data wait that has nothing to do with the model. The operators of an 8-wide MLP on
  // batches of 2 take a few us each on an idle machine; a loaded CI machine can stretch that
  // several times, so this test sets the host-bound threshold to 200 us (a 10x margin over the
  // default 20 us, which is what the threshold is about) and the data-bound share to 0.5 (batch
  // building is not what this test is about).
  for (const char* o :
       {"model.input_dim=8", "model.hidden_dim=8", "model.num_classes=2", "train.batch_size=2",
        "data.num_workers=0", "profile.host_bound_op_us=200", "profile.data_bound_share=0.5"}) {
    overrides.push_back(o);
  }
  const Verdict v =
      profiled_verdict(mlp_config(dir.path(), overrides),
                       make_datasets(mlp_config(dir.path(), overrides)), kShortScheduleSteps);
  EXPECT_EQ(v.bottleneck, "host-bound") << v.reason;
  EXPECT_LT(v.numbers["mean_op_us"].get<double>(), 200.0);
}

TEST(Verdict, AWideMlpWithBigBatchesIsComputeBound) {
  TempDir dir;
  auto overrides = kShortSchedule;
  for (const char* o : {"model.input_dim=512", "model.hidden_dim=2048", "train.batch_size=256",
                        "data.num_workers=0", "data.num_samples=2048"}) {
    overrides.push_back(o);
  }
  Config config = mlp_config(dir.path(), overrides);
  // Operators average hundreds of us (a 256x512x2048 matmul is ~0.5 GFLOP): a loaded machine
  // only slows them further, away from the 20 us host-bound threshold.
  const Verdict v = profiled_verdict(config, make_datasets(config), kShortScheduleSteps);
  EXPECT_EQ(v.bottleneck, "compute-bound") << v.reason;
  EXPECT_GT(v.numbers["mean_op_us"].get<double>(), 20.0);
}

}  // namespace
}  // namespace kiln::testing
