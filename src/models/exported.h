// Exported programs: a user's PyTorch model (a Python factory, or a Hugging Face causal LM)
// exported once by `kiln model import` (python/kiln_py/export_model.py, a child process) into a
// data-only package, and the "exported" model that trains it from C++ (model.name = "exported",
// model.package = DIR): its forward runs the package's graph through the dispatcher
// (models/exported_graph.h), backward is LibTorch autograd. docs/models.md "your PyTorch model".
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "kiln/models.h"

namespace kiln {

/// The package format this kiln reads (package.json "format_version").
inline constexpr int kPackageFormatVersion = 1;

struct ImportOptions {
  std::string module;                                 // "path/to/model.py:factory", or
  std::filesystem::path hf;                           // a Hugging Face save_pretrained directory
  nlohmann::json options = nlohmann::json::object();  // the factory's keyword arguments
  std::filesystem::path weights;  // optional safetensors replacing the initial weights
  std::filesystem::path out;      // the package directory
  int64_t max_seq = 0;            // the longest sequence (0: the HF config's context)
  int64_t max_batch = 0;          // the largest batch (0: 4096)
  std::string python;             // the Python with torch (and transformers for --hf)
  /// The module list whose entries are the units (activation checkpointing and FSDP wrap each):
  /// "" finds it (the nn.ModuleList holding the most parameters), "none" keeps the model whole.
  std::string units;
};

/// Exports the model into `out` (replaced only when the export succeeds). Returns the package's
/// manifest. Throws UserError with one line (a bad --module, a model torch.export cannot trace).
nlohmann::json import_model(const ImportOptions& options);

/// The manifest of the package in `dir`, checked: the format and version, the torch version it
/// was exported with against this LibTorch's, and (with `hashes`) every file's SHA-256. Throws
/// UserError naming `key` (the config key or flag that named the directory) and the fix.
nlohmann::json read_package(const std::filesystem::path& dir, const std::string& key, bool hashes);

/// `kiln model inspect`: what a package holds, as text (source, versions, input and ranges,
/// graph size and operators, parameters), after read_package with hashes.
std::string inspect_package(const std::filesystem::path& dir);

/// The "exported" model's registration (models/registry.cpp adds it with the built-ins).
ModelSpec exported_spec();

/// For the negative control of the equality test: the model's graph runs the first node calling
/// `target` ("torch.ops.aten.linear.default") under no-grad, breaking the gradient through it.
void set_exported_no_grad_op_for_test(Model& model, const std::string& target);

}  // namespace kiln
