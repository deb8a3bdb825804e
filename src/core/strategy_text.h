// A data-parallel strategy as every table prints it: "ddp", "fsdp x8", "does-not-fit". In core so
// that the plan (src/plan: plan.md) and the report (src/report: the plan rung's table,
// report.html), which may not include each other (tests/core/layering_test.cpp), print it one way.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace kiln {

/// `strategy` as the plan writes it ("ddp", "fsdp", "does-not-fit"); FSDP with its degree.
inline std::string strategy_text(std::string_view strategy, int64_t fsdp_degree) {
  return strategy == "fsdp" ? fmt::format("fsdp x{}", fsdp_degree) : std::string(strategy);
}

}  // namespace kiln
