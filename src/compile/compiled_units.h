// Per-unit compilation's UnitWrapper (src/compile/compiled_units.cpp); CompiledStep adds it to
// the model in per-unit mode. Internal to the compile component.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>

#include "compile/internal.h"
#include "kiln/compile.h"
#include "kiln/models.h"

namespace kiln {

/// The wrapper that runs each of `model`'s units through its compiled forward and backward
/// packages (built or found in the cache on a unit's first call with an input signature; units
/// of equal structure and signature share one pair), and, with compile.root, the model's root
/// pieces too (root_loss).
class CompiledUnitWrapper : public UnitWrapper {
 public:
  /// Whether root_loss runs the root compiled: compile.root = true and a model whose forward
  /// splits around its units (src/models/split_forward.h: gpt, llama).
  virtual bool compiles_root() const = 0;
  /// One micro-batch's loss (0-dim) with the root compiled: the piece before the units
  /// ("root.before_units": the embeddings) and the piece after them ("root.after_units": final
  /// norm, head and loss) each run as a forward package inside an autograd function whose
  /// backward runs the piece's backward package, and the units run between them through the
  /// model's unit wrappers as in forward(). Called under the precision's autocast, like
  /// forward(). A piece that cannot run compiled (graph breaks with compile.fullgraph = false,
  /// over compile.recompile_limit) runs the model's eager piece. Throws as run() does.
  virtual torch::Tensor root_loss(const torch::Tensor& inputs, const torch::Tensor& targets) = 0;
};

/// Appends to `report` (unit_graphs, the root pieces' entries named "root.before_units" and
/// "root.after_units" included; breaks, unit_recompiles, eager_unit_calls), which must outlive
/// the wrapper's use: CompiledStep owns both. `compile_root`: compile.root. Throws from run() and
/// root_loss(): UserError (a build failed, a malformed cache record), TrainingError (graph breaks
/// with compile.fullgraph = true). Training thread (and autograd's) only.
std::shared_ptr<CompiledUnitWrapper> make_compiled_units(
    const CompileOptions& options, TrainOptions::Precision precision, bool compile_root,
    Model& model, torch::Device device, const PackageCache& cache, const nlohmann::json& model_json,
    CompileReport& report);

}  // namespace kiln
