#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <stdexcept>

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

TEST(Strategy, RejectsNonsense) {
  auto bad = input(1, 1, 1, 80, 0);
  EXPECT_THROW(choose_strategy(bad), std::invalid_argument);
  bad = input(1, 1, 1, 80, 1);
  bad.headroom_fraction = 1.0;
  EXPECT_THROW(choose_strategy(bad), std::invalid_argument);
}

}  // namespace
}  // namespace kiln::testing
