// The parts of a loaded exported graph (models/exported_graph.h), shared by its loader
// (exported_graph.cpp) and its runner (exported_graph_run.cpp). Internal to src/models/.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "models/exported_graph.h"

namespace kiln {

// The loaded graph's parts (named, not anonymous: ExportedGraph::Impl holds them).
namespace graph_parts {

/// torch/_export/serde/schema.py's ScalarType, Layout and MemoryFormat values as c10's; nullopt
/// for a value this kiln does not know (exported_serde.cpp).
std::optional<c10::ScalarType> serde_scalar_type(int64_t v);
std::optional<c10::Layout> serde_layout(int64_t v);
std::optional<c10::MemoryFormat> serde_memory_format(int64_t v);
/// The symbol a size expression is ("s95", or "Symbol('s95', positive=True, integer=True)"), or
/// "" for an expression of symbols.
std::string bare_symbol(const std::string& expr);

// The argument of one schema position.
struct ArgSource {
  enum class Kind { kConstant, kSlot, kTensorList, kOptionalTensorList, kIntList, kDevice };
  Kind kind = Kind::kConstant;
  c10::IValue constant;
  int slot = -1;
  std::vector<int> slots;       // lists: a slot each, -1 for a constant (kIntList) or None
  std::vector<int64_t> values;  // kIntList: the constants where slots[i] == -1
};

struct Output {
  bool list = false;
  std::vector<int> slots;  // -1: not used by the graph
};

struct Node {
  enum class Kind { kOp, kSymSize, kSymNumel, kSymStride, kSymStorageOffset, kIntOp };
  Kind kind = Kind::kOp;
  std::string name, target;
  std::optional<c10::OperatorHandle> op;
  std::vector<ArgSource> args;
  std::vector<Output> outputs;
  std::vector<int> release;  // slots last used here
  char int_op = 0;
  std::vector<std::string> module_paths;  // nn_module_stack's paths, outermost first
};

/// The slots a node reads.
std::vector<int> slots_read(const Node& node);

// How one unit runs (ExportedGraph::split_units).
struct UnitPlan {
  size_t begin = 0, end = 0;  // its nodes
  int in_slot = -1, out_slot = -1;
  std::vector<int> captured;       // the other slots it reads that are defined before it
  std::vector<int> release_after;  // slots defined before it whose last reader is in it
};

}  // namespace graph_parts

struct ExportedGraph::Impl {
  using ArgSource = graph_parts::ArgSource;
  using Node = graph_parts::Node;
  using Output = graph_parts::Output;
  std::string file;
  std::vector<Node> nodes;
  std::map<std::string, int> slot_of;
  int slots = 0;
  std::vector<int> input_slots;
  std::vector<int> user_output_slots, buffer_output_slots;
  std::map<std::string, std::pair<std::vector<int64_t>, bool>>
      tensor_sizes;  // name -> (sizes, static)
  GraphMath math;
  std::set<int> lookup_inputs, used_inputs;       // slots read by an embedding lookup, by others
  std::vector<graph_parts::UnitPlan> unit_plans;  // ExportedGraph::split_units

  // Loading (exported_graph.cpp).
  [[noreturn]] void fail(const std::string& node, const std::string& what) const;
  int define(const std::string& name, const std::string& node);
  int use(const std::string& name, const std::string& node) const;
  ArgSource convert(const nlohmann::json& arg, const c10::Argument& schema_arg, const Node& node);
  void load_op(Node& node, const nlohmann::json& n);
  void bind_outputs(Node& node, const nlohmann::json& n);
  void load_node(const nlohmann::json& n);
};

}  // namespace kiln
