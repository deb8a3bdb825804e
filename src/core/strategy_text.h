// A data-parallel strategy as every table prints it: "ddp", "fsdp x8", "hsdp 2x4", "does-not-fit".
// In core so that the plan (src/plan: plan.md) and the report (src/report: the plan rung's table,
// report.html), which may not include each other (tests/core/layering_test.cpp), print it one way.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln {

/// `strategy` as the plan writes it ("ddp", "fsdp", "does-not-fit"); FSDP with its degree over
/// `gpus`: "fsdp x8" over every GPU, "hsdp 2x4" (hybrid sharding: 2 replicas, dp_replicate, of
/// shard groups of 4, dp_shard; what dist.strategy = "auto" runs, or "fsdp" with
/// dist.dp_replicate = 2) when the degree is below the GPU count.
/// With tensor parallelism (`tp` > 1) the degree is that of the shard group over the TP slices and
/// " tp N" follows: "fsdp x4 tp 2" (8 GPUs), "hsdp 2x4 tp 8" (64).
inline std::string strategy_text(std::string_view strategy, int64_t fsdp_degree, int64_t gpus,
                                 int64_t tp = 1) {
  if (strategy != "fsdp") return std::string(strategy);
  const std::string tp_text = tp > 1 ? fmt::format(" tp {}", tp) : "";
  const int64_t dp = gpus / std::max<int64_t>(tp, 1);
  if (fsdp_degree > 0 && dp > fsdp_degree)
    return fmt::format("hsdp {}x{}{}", dp / fsdp_degree, fsdp_degree, tp_text);
  return fmt::format("fsdp x{}{}", fsdp_degree, tp_text);
}

}  // namespace kiln
