// Shapes, graphs and recompiles: which compiled graph accepts a micro-batch, and when a new one
// is built, as torch.compile's guards, its dynamic= setting and its recompile_limit decide.
// Bookkeeping only: nothing here compiles.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "compile/internal.h"
#include "core/strings.h"
#include "kiln/compile.h"

namespace kiln {

namespace {

const std::vector<int64_t>& tensor_shape(const InputShapes& shapes, const std::string& tensor) {
  return tensor == "inputs" ? shapes.inputs : shapes.targets;
}

// The shape with dynamic dimensions written as their names.
std::string symbolic(const std::vector<int64_t>& shape, const std::string& tensor,
                     const std::vector<DynamicDim>& dynamic) {
  std::vector<std::string> parts;
  for (size_t d = 0; d < shape.size(); ++d) {
    std::string part = std::to_string(shape[d]);
    for (const DynamicDim& dim : dynamic) {
      if (dim.tensor == tensor && dim.dim == static_cast<int>(d)) part = dim.name;
    }
    parts.push_back(part);
  }
  return fmt::format("[{}]", fmt::join(parts, ", "));
}

// "inputs dim 1 changed 16 -> 8 (seq)", one clause per changed dimension.
std::string shape_change(const InputShapes& from, const InputShapes& to,
                         const std::vector<DynamicDim>& candidates) {
  std::vector<std::string> changes;
  for (const char* tensor : {"inputs", "targets"}) {
    const auto& a = tensor_shape(from, tensor);
    const auto& b = tensor_shape(to, tensor);
    if (a.size() != b.size()) {
      changes.push_back(fmt::format("{} rank changed {} -> {}", tensor, a.size(), b.size()));
      continue;
    }
    for (size_t d = 0; d < a.size(); ++d) {
      if (a[d] == b[d]) continue;
      std::string name;
      for (const DynamicDim& dim : candidates) {
        if (dim.tensor == tensor && dim.dim == static_cast<int>(d)) name = " (" + dim.name + ")";
      }
      changes.push_back(fmt::format("{} dim {} changed {} -> {}{}", tensor, d, a[d], b[d], name));
    }
  }
  return fmt::format("{}", fmt::join(changes, ", "));
}

bool in_range(const InputShapes& shapes, const DynamicDim& dim) {
  const auto& shape = tensor_shape(shapes, dim.tensor);
  if (dim.dim >= static_cast<int>(shape.size())) return false;
  const int64_t size = shape[static_cast<size_t>(dim.dim)];
  return size >= dim.min && size <= dim.max;
}

// A graph for `shapes` whose dimensions named in `names` are dynamic. A symbol is kept only when
// every dimension bearing it is in range (the same symbol must hold one size).
GraphShape graph_with(const InputShapes& shapes, const std::vector<DynamicDim>& candidates,
                      const std::vector<std::string>& names) {
  GraphShape out{shapes, {}};
  for (const std::string& name : names) {
    std::vector<DynamicDim> same;
    bool usable = true;
    for (const DynamicDim& dim : candidates) {
      if (dim.name != name) continue;
      same.push_back(dim);
      usable = usable && in_range(shapes, dim);
    }
    if (usable) out.dynamic.insert(out.dynamic.end(), same.begin(), same.end());
  }
  return out;
}

}  // namespace

std::string InputShapes::str() const {
  return fmt::format("inputs {}, targets {}", shape_text(inputs), shape_text(targets));
}

InputShapes InputShapes::of(const Batch& batch) {
  return {batch.inputs.sizes().vec(), batch.targets.sizes().vec()};
}

bool GraphShape::accepts(const InputShapes& candidate) const {
  for (const char* tensor : {"inputs", "targets"}) {
    const auto& mine = tensor_shape(shapes, tensor);
    const auto& theirs = tensor_shape(candidate, tensor);
    if (mine.size() != theirs.size()) return false;
    for (size_t d = 0; d < mine.size(); ++d) {
      const DynamicDim* symbol = nullptr;
      for (const DynamicDim& dim : dynamic) {
        if (dim.tensor == tensor && dim.dim == static_cast<int>(d)) symbol = &dim;
      }
      if (symbol ? (theirs[d] < symbol->min || theirs[d] > symbol->max) : theirs[d] != mine[d]) {
        return false;
      }
    }
  }
  // Dimensions bearing the same symbol must agree.
  for (const DynamicDim& a : dynamic) {
    for (const DynamicDim& b : dynamic) {
      if (a.name == b.name && tensor_shape(candidate, a.tensor)[static_cast<size_t>(a.dim)] !=
                                  tensor_shape(candidate, b.tensor)[static_cast<size_t>(b.dim)]) {
        return false;
      }
    }
  }
  return true;
}

std::string GraphShape::str() const {
  std::string text =
      fmt::format("inputs {}, targets {}", symbolic(shapes.inputs, "inputs", dynamic),
                  symbolic(shapes.targets, "targets", dynamic));
  std::vector<std::string> ranges;
  for (const DynamicDim& dim : dynamic) {
    const std::string range = fmt::format("{} in [{}, {}]", dim.name, dim.min, dim.max);
    if (std::find(ranges.begin(), ranges.end(), range) == ranges.end()) ranges.push_back(range);
  }
  if (!ranges.empty()) text += fmt::format(" ({})", fmt::join(ranges, ", "));
  return text;
}

nlohmann::json GraphShape::to_json() const {
  nlohmann::json dims = nlohmann::json::array();
  for (const DynamicDim& d : dynamic) {
    dims.push_back(
        {{"tensor", d.tensor}, {"dim", d.dim}, {"name", d.name}, {"min", d.min}, {"max", d.max}});
  }
  return {{"inputs", shapes.inputs}, {"targets", shapes.targets}, {"dynamic", dims}};
}

std::vector<DynamicDim> dynamic_candidates(const InputShapes& shapes, int64_t max_seq_len) {
  constexpr int64_t kMaxBatch = 65536;
  std::vector<DynamicDim> out;
  if (!shapes.inputs.empty() && !shapes.targets.empty()) {
    out.push_back({"inputs", 0, "batch", 2, kMaxBatch});
    out.push_back({"targets", 0, "batch", 2, kMaxBatch});
  }
  if (shapes.inputs.size() == 2 && shapes.targets.size() == 2 && max_seq_len >= 2) {
    out.push_back({"inputs", 1, "seq", 2, max_seq_len});
    out.push_back({"targets", 1, "seq", 2, max_seq_len});
  }
  return out;
}

ShapeTracker::ShapeTracker(CompileOptions::Dynamic dynamic, int recompile_limit,
                           int64_t max_seq_len)
    : dynamic_(dynamic), limit_(std::max(1, recompile_limit)), max_seq_len_(max_seq_len) {}

ShapeTracker::Decision ShapeTracker::decide(const InputShapes& shapes) const {
  using Kind = Decision::Kind;
  for (size_t g = 0; g < graphs_.size(); ++g) {
    if (graphs_[g].accepts(shapes)) return {Kind::kReuse, g, {}, ""};
  }
  const std::vector<DynamicDim> candidates = dynamic_candidates(shapes, max_seq_len_);
  std::vector<std::string> names;
  for (const DynamicDim& dim : candidates) {
    if (std::find(names.begin(), names.end(), dim.name) == names.end()) names.push_back(dim.name);
  }
  if (graphs_.empty()) {
    const bool dynamic = dynamic_ == CompileOptions::Dynamic::kDynamic;
    return {Kind::kCompile, 0,
            graph_with(shapes, candidates, dynamic ? names : std::vector<std::string>{}), ""};
  }
  const std::string change = shape_change(graphs_.front().shapes, shapes, candidates);
  if (std::find(eager_.begin(), eager_.end(), shapes) != eager_.end()) {
    return {Kind::kEager, 0, {}, change + " (runs eager: over compile.recompile_limit)"};
  }
  if (static_cast<int>(graphs_.size()) >= limit_) {
    return {Kind::kEager,
            0,
            {},
            fmt::format("{}; compile.recompile_limit = {} reached, so {} runs eager", change,
                        limit_, shapes.str())};
  }
  std::vector<std::string> dynamic_names;
  if (dynamic_ == CompileOptions::Dynamic::kDynamic) {
    dynamic_names = names;
  } else if (dynamic_ == CompileOptions::Dynamic::kAuto) {
    // The symbols of the dimensions that changed since the first graph become dynamic.
    const InputShapes& first = graphs_.front().shapes;
    for (const DynamicDim& dim : candidates) {
      const auto& a = tensor_shape(first, dim.tensor);
      const auto& b = tensor_shape(shapes, dim.tensor);
      const auto d = static_cast<size_t>(dim.dim);
      if (d < a.size() && d < b.size() && a[d] != b[d] &&
          std::find(dynamic_names.begin(), dynamic_names.end(), dim.name) == dynamic_names.end()) {
        dynamic_names.push_back(dim.name);
      }
    }
  }
  GraphShape shape = graph_with(shapes, candidates, dynamic_names);
  std::string how = shape.dynamic.empty() ? "a static graph" : "a dynamic graph";
  return {Kind::kCompile, graphs_.size(), shape,
          fmt::format("{}: {} for {}", change, how, shape.str())};
}

void ShapeTracker::record(const InputShapes& shapes, const Decision& decision) {
  switch (decision.kind) {
    case Decision::Kind::kReuse:
      return;
    case Decision::Kind::kCompile:
      if (!graphs_.empty()) recompiles_.push_back({shapes, decision.reason, true});
      graphs_.push_back(decision.shape);
      return;
    case Decision::Kind::kEager:
      if (std::find(eager_.begin(), eager_.end(), shapes) != eager_.end()) return;
      eager_.push_back(shapes);
      recompiles_.push_back({shapes, decision.reason, false});
      return;
  }
}

std::string describe_breaks(const std::vector<GraphBreak>& breaks) {
  std::vector<std::string> lines;
  for (const GraphBreak& b : breaks) {
    lines.push_back(
        fmt::format("graph break at {}: {}", b.where.empty() ? "?" : b.where, b.reason));
  }
  return fmt::format("{}", fmt::join(lines, "; "));
}

}  // namespace kiln
