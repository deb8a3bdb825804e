#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <stdexcept>

#include "core/strategy_text.h"
#include "kiln/plan.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

constexpr double kGB = 1e9;

StrategyInput input(double state_gb, double unit_gb, double activations_gb, double device_gb,
                    int64_t gpus) {
  StrategyInput in;
  in.ddp_model_state_bytes = state_gb * kGB;
  in.largest_unit_parameter_bytes = unit_gb * kGB;
  in.activation_bytes = activations_gb * kGB;
  in.device_memory_bytes = device_gb * kGB;
  in.headroom_fraction = 0.1;
  in.gpu_count = gpus;
  return in;
}

TEST(Strategy, DdpWhenStateAndActivationsFit) {
  auto d = choose_strategy(input(20, 0.5, 10, 80, 8));
  EXPECT_EQ(d.strategy, "ddp");
  EXPECT_EQ(d.fsdp_degree, 0);
  EXPECT_DOUBLE_EQ(d.usable_bytes, 72 * kGB);
  EXPECT_DOUBLE_EQ(d.ddp_bytes_per_device, 30 * kGB);
  EXPECT_DOUBLE_EQ(d.fsdp_bytes_per_device, (20.0 / 8 + 0.5 + 10) * kGB);
  EXPECT_THAT(d.reason, HasSubstr("30.0 GB"));
}

// Mixed precision: DDP holds autocast's bf16 copies of the whole model at its peak; FSDP gathers
// each unit in bf16 itself (the unit term), so the copies do not follow it.
TEST(Strategy, DdpCountsTheWholeModelsWeightCopiesFsdpDoesNot) {
  StrategyInput in = input(60, 1, 10, 80, 8);  // 70 GB <= 72 usable: DDP without copies
  EXPECT_EQ(choose_strategy(in).strategy, "ddp");
  in.weight_copy_bytes = 7.5 * kGB;  // 3.75e9 parameters x 2 B
  const StrategyDecision d = choose_strategy(in);
  EXPECT_EQ(d.strategy, "fsdp");
  EXPECT_DOUBLE_EQ(d.ddp_bytes_per_device, 77.5 * kGB);
  EXPECT_DOUBLE_EQ(d.fsdp_bytes_per_device, (60.0 / 2 + 1 + 10) * kGB);
  EXPECT_THAT(d.reason, HasSubstr("state 60.0 GB + weight copies 7.5 GB + activations 10.0 GB"));
  // Nothing fits: the advice leaves out what the job already does.
  StrategyInput huge = input(6000, 1, 10, 80, 8);
  EXPECT_THAT(choose_strategy(huge).reason, HasSubstr("use activation checkpointing"));
  huge.activation_checkpointing = true;
  EXPECT_THAT(choose_strategy(huge).reason, HasSubstr("; use a smaller micro-batch or more GPUs"));
}

TEST(Strategy, FsdpAtTheSmallestDegreeThatFits) {
  // 107 GB of state: /2 = 53.5 + 1 + 10 = 64.5 <= 72 usable.
  auto d = choose_strategy(input(107, 1, 10, 80, 8));
  EXPECT_EQ(d.strategy, "fsdp");
  EXPECT_EQ(d.fsdp_degree, 2);
  EXPECT_DOUBLE_EQ(d.fsdp_bytes_per_device, (107.0 / 2 + 1 + 10) * kGB);
  EXPECT_THAT(d.reason, HasSubstr("fsdp over 2"));
  // With 50 GB of activations only degree 8 leaves room.
  auto tight = choose_strategy(input(107, 1, 50, 80, 8));
  EXPECT_EQ(tight.strategy, "fsdp");
  EXPECT_EQ(tight.fsdp_degree, 8);  // /4 = 26.75 + 51 = 77.75 > 72; /8 = 13.4 + 51 = 64.4
}

TEST(Strategy, DegreesAreDivisorsOfTheGpuCount) {
  // 6 GPUs: degrees 2, 3, 6. /2 = 53.5 + 21 = 74.5 > 72; /3 = 35.7 + 21 = 56.7 fits.
  auto d = choose_strategy(input(107, 1, 20, 80, 6));
  EXPECT_EQ(d.strategy, "fsdp");
  EXPECT_EQ(d.fsdp_degree, 3);
}

TEST(Strategy, DoesNotFitNamesTheWaysOut) {
  auto d = choose_strategy(input(107, 1, 80, 80, 8));
  EXPECT_EQ(d.strategy, "does-not-fit");
  EXPECT_EQ(d.fsdp_degree, 0);
  EXPECT_THAT(d.reason, HasSubstr("activation checkpointing"));
  EXPECT_THAT(d.reason, HasSubstr("more GPUs"));
  auto single = choose_strategy(input(107, 1, 1, 80, 1));
  EXPECT_EQ(single.strategy, "does-not-fit");
  EXPECT_DOUBLE_EQ(single.fsdp_bytes_per_device, single.ddp_bytes_per_device);
}

// Two nodes of 8: state 1000 GB, unit 8 GB, activations 20 GB, 141 GB devices (126.9 usable).
// Inside a node FSDP over 8 needs 125 + 8 + 20 = 153 GB: no. Across nodes FSDP over 16 needs
// 62.5 + 8 + 20 = 90.5 GB; TP slices 98% of the state: tp 8 x fsdp 2 keeps 1 - 0.98 + 0.98/8 =
// 0.1425 of it: 71.25 + 8 + 20 = 99.25 GB. Both fit; the links decide.
StrategyInput two_nodes() {
  StrategyInput in = input(1000, 8, 20, 141, 16);
  in.gpus_per_node = 8;
  in.tensor_parallel_degrees = {2, 4, 8};
  in.tensor_parallel_fraction = 0.98;
  in.tensor_parallel_unit_bytes = {{2, 8 * kGB}, {4, 8 * kGB}, {8, 8 * kGB}};
  in.parameter_bytes = 250 * kGB;
  in.tensor_parallel_bytes = 40 * kGB;
  in.grad_accum_steps = 4;
  in.intra_node_bytes_per_second = 450 * kGB;
  in.inter_node_bytes_per_second = 50 * kGB;
  return in;
}

TEST(Strategy, TensorParallelInsideANodeWhenItCommunicatesLessThanFsdpAcrossNodes) {
  const StrategyDecision d = choose_strategy(two_nodes());
  EXPECT_EQ(d.strategy, "fsdp");
  EXPECT_EQ(d.tp_degree, 8);
  EXPECT_EQ(d.fsdp_degree, 2);
  EXPECT_NEAR(d.fsdp_bytes_per_device, (1000 * 0.1425 / 2 + 8 + 20) * kGB, 1e6);
  // tp 8: 4 x 80 x 7/8 / 450 = 0.622 s; fsdp 2 over the network (span 16): 4 x 750 x 0.1425 x
  // 1/2 / 50 = 4.275 s. FSDP over 16: 4 x 750 x 15/16 / 50 = 56.25 s.
  EXPECT_NEAR(d.communication_seconds, 0.6222 + 4.275, 1e-3);
  EXPECT_THAT(d.reason, HasSubstr("fsdp over 16 56.2 s"));
  EXPECT_THAT(d.reason, HasSubstr("fsdp over 2 x tp 8"));
}

TEST(Strategy, NoTensorParallelWithoutAPlanOrWhenANodeShardsTheModel) {
  // Negative controls: the model has no TP plan -> FSDP across the nodes.
  StrategyInput no_plan = two_nodes();
  no_plan.tensor_parallel_degrees.clear();
  const StrategyDecision fsdp = choose_strategy(no_plan);
  EXPECT_EQ(fsdp.tp_degree, 1);
  EXPECT_EQ(fsdp.fsdp_degree, 16);
  EXPECT_THAT(fsdp.reason, HasSubstr("the only layout that fits"));
  // A network as fast as NVLink and 10x the activations to all-reduce: FSDP over 16 (4 x 750 x
  // 15/16 / 450 = 6.25 s) communicates less than tp 8 (4 x 800 x 7/8 / 450 = 6.22 s + 0.475 s).
  StrategyInput fast = two_nodes();
  fast.inter_node_bytes_per_second = 450 * kGB;
  fast.tensor_parallel_bytes = 400 * kGB;
  EXPECT_EQ(choose_strategy(fast).tp_degree, 1);
  // State that shards inside a node (500 GB / 8 + 28 = 90.5): hybrid sharding, no TP.
  StrategyInput small = two_nodes();
  small.ddp_model_state_bytes = 500 * kGB;
  const StrategyDecision hsdp = choose_strategy(small);
  EXPECT_EQ(hsdp.tp_degree, 1);
  EXPECT_EQ(hsdp.fsdp_degree, 8);
  // Bandwidths unknown: FSDP, the layout of fewer dimensions.
  StrategyInput unknown = two_nodes();
  unknown.inter_node_bytes_per_second = 0;
  const StrategyDecision first = choose_strategy(unknown);
  EXPECT_EQ(first.tp_degree, 1);
  EXPECT_THAT(first.reason, HasSubstr("bandwidths unknown"));
}

TEST(Strategy, TheTablesWriteTheLayout) {
  EXPECT_EQ(strategy_text("ddp", 0, 8), "ddp");
  EXPECT_EQ(strategy_text("fsdp", 8, 8), "fsdp x8");
  EXPECT_EQ(strategy_text("fsdp", 4, 8), "hsdp 2x4");
  EXPECT_EQ(strategy_text("fsdp", 2, 16, 8), "fsdp x2 tp 8");
  EXPECT_EQ(strategy_text("fsdp", 2, 32, 8), "hsdp 2x2 tp 8");
  EXPECT_EQ(strategy_text("does-not-fit", 0, 16, 8), "does-not-fit");
}

TEST(Strategy, RejectsNonsense) {
  auto bad = input(1, 1, 1, 80, 0);
  EXPECT_THROW(choose_strategy(bad), std::invalid_argument);
  bad = input(1, 1, 1, 80, 1);
  bad.headroom_fraction = 1.0;
  EXPECT_THROW(choose_strategy(bad), std::invalid_argument);
}

}  // namespace
}  // namespace kiln::testing
