// The compile rung's parts shared by its two files (private to src/rungs): compile.cpp measures
// both sides and fills compile.json's typed result (kiln/results.h CompileResult);
// compile_report.cpp turns that result into the rung's table and verdict.
#pragma once

#include <string>
#include <utility>

#include "kiln/compile.h"
#include "kiln/config.h"
#include "kiln/results.h"

namespace kiln::compile_rung {

/// The DDP overlap row of the table ("2 ranks (gloo): all-reduce exposed per step ...").
std::string ddp_overlap_text(const CompileDdp& ddp);

/// The rung's table for a timed result (numbers.timed): `report` is the compiler's that decided
/// the graphs (AOTInductor's, else the capture's), `eval_report` AOTInductor's (its eval graphs;
/// nullptr without one).
ResultRows compile_table(const CompileResult& numbers, const CompileReport& report,
                         const CompileReport* eval_report, const CompileOptions& options);

/// The gate and the verdict of a timed result: numerics within tolerance (steps, parameters,
/// evaluations), then the speedup against compile.min_speedup. `steps` is the steps each side
/// ran (for the parameters' line).
std::pair<bool, std::string> compile_verdict(const CompileResult& numbers, int64_t steps);

}  // namespace kiln::compile_rung
