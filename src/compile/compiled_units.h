// Per-unit compilation's UnitWrapper (src/compile/compiled_units.cpp); CompiledStep adds it to
// the model in per-unit mode. Internal to the compile component.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>

#include "kiln/compile.h"
#include "kiln/models.h"

namespace kiln {

/// The wrapper that runs each of `model`'s units through its compiled forward and backward
/// packages (built or found in `cache` on a unit's first call with an input signature; units of
/// equal structure and signature share one pair). Appends to `report` (unit_graphs, breaks,
/// unit_recompiles, eager_unit_calls), which must outlive the wrapper's use: CompiledStep owns
/// both. Throws from run(): UserError (a build failed, a malformed cache record), TrainingError
/// (graph breaks with compile.fullgraph = true). Training thread (and autograd's) only.
std::shared_ptr<UnitWrapper> make_compiled_units(const CompileOptions& options,
                                                 TrainOptions::Precision precision, Model& model,
                                                 torch::Device device, const PackageCache& cache,
                                                 const nlohmann::json& model_json,
                                                 CompileReport& report);

}  // namespace kiln
