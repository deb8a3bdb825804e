// The "exported" model (models/exported.h): a package `kiln model import` wrote, read and checked
// once, its graph run by the dispatcher with kiln's own parameters.
#include "models/exported.h"

#include <fmt/format.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "core/files.h"
#include "core/python_child.h"
#include "core/schema_sections.h"
#include "kiln/build_info.h"
#include "kiln/error.h"
#include "kiln/hf.h"
#include "kiln/safetensors.h"
#include "models/exported_graph.h"
#include "models/internal.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string libtorch_version() {
  return fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
}

// "2.13.0+cpu" -> "2.13.0": CPU and CUDA builds of one release share their operators.
std::string release_of(const std::string& version) {
  return version.substr(0, version.find('+'));
}

std::string sizes_text(const std::vector<int64_t>& sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

// The graph split into the units package.json lists ("units": {"prefix", "count"}, or null).
// Returns "" or the problem.
std::string split_package_units(ExportedGraph& graph, const json& manifest) {
  const json units = manifest.value("units", json());
  if (!units.is_object()) return "";
  return graph.split_units(units.value("prefix", ""), units.value("count", int64_t{0}));
}

std::shared_ptr<const ExportedGraph> load_graph(const fs::path& dir, const json& manifest) {
  const json& graphs = manifest.at("graphs");
  if (graphs.size() != 1 || graphs[0].value("name", "") != "forward") {
    throw UserError(
        fmt::format("{}: package.json lists graphs kiln does not run (one 'forward' "
                    "graph expected); re-import with this kiln",
                    dir.string()));
  }
  const fs::path file = dir / graphs[0].at("file").get<std::string>();
  json program;
  try {
    program = json::parse(read_file(file));
  } catch (const json::exception& e) {
    throw UserError(fmt::format("{}: not JSON ({})", file.string(), e.what()));
  }
  auto graph = std::make_shared<ExportedGraph>(program, file.string());
  if (std::string problem = split_package_units(*graph, manifest); !problem.empty()) {
    throw UserError(
        fmt::format("{}: the units package.json lists ({}) do not split the graph: "
                    "{}; re-import with --units none or another --units",
                    dir.string(), manifest["units"].dump(), problem));
  }
  return graph;
}

class ExportedModel : public Model {
 public:
  ExportedModel(fs::path dir, json manifest, std::shared_ptr<const ExportedGraph> graph)
      : dir_(std::move(dir)), manifest_(std::move(manifest)), graph_(std::move(graph)) {
    std::map<std::string, torch::Tensor> weights;
    const fs::path file = dir_ / manifest_.at("weights").at("file").get<std::string>();
    for (auto& [name, tensor] : read_safetensors(file)) weights[name] = tensor;
    for (size_t i = 0; i < graph_->inputs().size(); ++i) {
      const GraphInput& input = graph_->inputs()[i];
      if (input.kind == GraphInput::Kind::kUserInput) {
        if (user_input_ >= 0) {
          throw UserError(
              fmt::format("{}: the graph takes more than one input; kiln feeds one "
                          "(token ids [B, T])",
                          dir_.string()));
        }
        user_input_ = static_cast<int64_t>(i);
        tensors_.emplace_back();
        continue;
      }
      auto it = weights.find(input.name);
      if (it == weights.end()) {
        throw UserError(
            fmt::format("{}: {} holds no tensor '{}', which the graph takes; "
                        "re-import the package",
                        dir_.string(), file.string(), input.name));
      }
      torch::Tensor value = it->second;
      std::vector<int64_t> sizes(value.sizes().begin(), value.sizes().end());
      if (sizes != input.sizes || value.scalar_type() != input.dtype) {
        throw UserError(fmt::format("{}: '{}' is {} {} in the weights but {} {} in the graph",
                                    dir_.string(), input.name, c10::toString(value.scalar_type()),
                                    sizes_text(sizes), c10::toString(input.dtype),
                                    sizes_text(input.sizes)));
      }
      torch::nn::Module& owner = module_for(input.name);
      const std::string leaf = input.name.substr(input.name.rfind('.') + 1);
      if (input.kind == GraphInput::Kind::kParameter) {
        tensors_.push_back(owner.register_parameter(leaf, value, /*requires_grad=*/true));
      } else {
        tensors_.push_back(owner.register_buffer(leaf, value));
      }
      by_name_[input.name] = tensors_.size() - 1;
    }
    if (user_input_ < 0) {
      throw UserError(fmt::format("{}: the graph takes no input", dir_.string()));
    }
  }

  torch::Tensor forward(const torch::Tensor& inputs) override {
    if (std::string problem = graph_->check_user_input(static_cast<size_t>(user_input_), inputs);
        !problem.empty()) {
      throw UserError(fmt::format("model.package = \"{}\": {}", dir_.string(), problem));
    }
    std::vector<at::Tensor> args = tensors_;
    args[static_cast<size_t>(user_input_)] = inputs;
    std::vector<at::Tensor> outputs =
        graph_->units().empty()
            ? graph_->run(args, inputs.device())
            : graph_->run(args, inputs.device(),
                          [this](int k, const UnitForward& forward, const at::Tensor& input) {
                            return run_unit(k, forward, input);
                          });
    const auto& mutated = graph_->mutated_buffers();
    if (!mutated.empty()) {
      torch::NoGradGuard no_grad;
      const size_t users = outputs.size() - mutated.size();
      for (size_t k = 0; k < mutated.size(); ++k) {
        tensors_[by_name_.at(mutated[k])].copy_(outputs[users + k]);
      }
    }
    return outputs.at(0);
  }

  std::string architecture() const override { return "exported"; }

  std::vector<ModelUnit> units() const override {
    std::vector<ModelUnit> out;
    for (const GraphUnit& unit : graph_->units()) out.push_back({unit.name, unit.parameters});
    return out;
  }

  nlohmann::json describe() const override {
    const json& graph = manifest_["graphs"][0];
    return {{"name", "exported"},
            {"package", fs::absolute(dir_).lexically_normal().string()},
            {"source", manifest_.value("source", json::object())},
            {"versions", manifest_.value("versions", json::object())},
            {"graph_sha256", graph.value("sha256", "")},
            {"weights_sha256", manifest_["weights"].value("sha256", "")},
            {"nodes", graph_->node_count()},
            {"units", manifest_.value("units", json())},
            {"vocab_size", manifest_["input"].value("vocab_size", int64_t{0})}};
  }

  double train_flops_per_sample(int64_t seq_len) const override {
    const GraphMath m = graph_->math();
    ModelMath math;
    math.flop_parameters = m.flop_parameters;
    math.n_layer = m.attention_layers;
    math.attention_width = m.attention_width;
    return math.train_flops_per_token(seq_len) * static_cast<double>(seq_len);
  }

  ExportedGraph& graph_for_test() { return const_cast<ExportedGraph&>(*graph_); }

 private:
  // The (empty) module that owns `name`'s leaf, made on the way: "model.layers.0.mlp.weight" ->
  // model -> layers -> 0 -> mlp, so named_parameters() spells the state_dict names.
  torch::nn::Module& module_for(const std::string& name) {
    torch::nn::Module* at = this;
    std::string path;
    size_t start = 0;
    for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', start)) {
      const std::string part = name.substr(start, dot - start);
      path += (path.empty() ? "" : ".") + part;
      auto it = submodules_.find(path);
      if (it == submodules_.end()) {
        auto child = std::make_shared<torch::nn::Module>(part);
        at->register_module(part, child);
        it = submodules_.emplace(path, child).first;
      }
      at = it->second.get();
      start = dot + 1;
    }
    return *at;
  }

  fs::path dir_;
  json manifest_;
  std::shared_ptr<const ExportedGraph> graph_;
  std::vector<torch::Tensor> tensors_;  // per graph input (the user input's slot empty)
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::shared_ptr<torch::nn::Module>> submodules_;
  int64_t user_input_ = -1;
};

bool is_exported(const Config& c) {
  return ModelBuildOptions::from_config(c).name == "exported";
}

// The configured package's manifest (no hashes) or the problem.
std::string package_problem(const Config& c, json* manifest) {
  try {
    *manifest = read_package(ModelBuildOptions::from_config(c).package, "model.package", false);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

// The first buffer the package's graph writes (a buffer_mutation output), or "".
std::string written_buffer(const fs::path& dir, const json& manifest) {
  try {
    const json program =
        json::parse(read_file(dir / manifest.at("graphs").at(0).at("file").get<std::string>()));
    for (const json& spec : program.at("graph_module").at("signature").at("output_specs")) {
      if (spec.contains("buffer_mutation")) {
        return spec["buffer_mutation"].value("buffer_name", std::string("?"));
      }
    }
  } catch (const std::exception&) {
    return "";  // an unreadable graph is refused when the model is built, naming the file
  }
  return "";
}

}  // namespace

json read_package(const fs::path& dir, const std::string& key, bool hashes) {
  const fs::path file = dir / "package.json";
  if (!fs::is_regular_file(file)) {
    throw UserError(
        fmt::format("{} = \"{}\" holds no package.json; write a package with `kiln "
                    "model import ... --out {}`",
                    key, dir.string(), dir.string()));
  }
  json manifest;
  try {
    manifest = json::parse(read_file(file));
  } catch (const json::exception& e) {
    throw UserError(
        fmt::format("{}: not JSON ({}); re-import the package", file.string(), e.what()));
  }
  if (!manifest.is_object() || manifest.value("format", "") != "kiln-exported-model") {
    throw UserError(fmt::format("{} is not a kiln model package (format \"kiln-exported-model\")",
                                file.string()));
  }
  if (manifest.value("format_version", 0) != kPackageFormatVersion) {
    throw UserError(
        fmt::format("{}: package format_version {} is not this kiln's {}; re-import "
                    "with `kiln model import`",
                    file.string(), manifest.value("format_version", 0), kPackageFormatVersion));
  }
  const std::string torch =
      manifest.value("versions", json::object()).value("torch", std::string("?"));
  if (release_of(torch) != libtorch_version()) {
    throw UserError(
        fmt::format("{} = \"{}\" was exported with torch {}, and this kiln runs "
                    "LibTorch {}: operator schemas change between releases; re-import "
                    "it with the Python of this LibTorch",
                    key, dir.string(), torch, libtorch_version()));
  }
  if (!manifest.contains("graphs") || !manifest.contains("weights") ||
      !manifest.contains("input")) {
    throw UserError(
        fmt::format("{}: package.json lacks graphs, weights or input; re-import", file.string()));
  }
  if (hashes) {
    std::vector<json> files(manifest["graphs"].begin(), manifest["graphs"].end());
    files.push_back(manifest["weights"]);
    for (const json& entry : files) {
      const fs::path path = dir / entry.value("file", "");
      if (!fs::is_regular_file(path)) {
        throw UserError(fmt::format("{} = \"{}\": {} is missing; re-import the package", key,
                                    dir.string(), path.string()));
      }
      if (sha256_file(path) != entry.value("sha256", "")) {
        throw UserError(
            fmt::format("{} = \"{}\": {} does not match its SHA-256 in package.json "
                        "(changed after import); re-import the package",
                        key, dir.string(), path.string()));
      }
    }
  }
  return manifest;
}

json import_model(const ImportOptions& options) {
  if (options.module.empty() == options.hf.empty()) {
    throw UserError(
        "kiln model import: give one source, --module path/to/model.py:factory or "
        "--hf DIR");
  }
  if (options.out.empty()) throw UserError("kiln model import: --out DIR is required");
  json spec = {{"out", fs::absolute(options.out).string()},
               {"options", options.options},
               {"max_seq", options.max_seq},
               {"max_batch", options.max_batch},
               {"kiln_version", build_info().version}};
  if (!options.module.empty()) spec["module"] = options.module;
  if (!options.hf.empty()) spec["hf"] = fs::absolute(options.hf).string();
  if (!options.units.empty()) spec["units"] = options.units;
  if (!options.weights.empty()) spec["weights"] = fs::absolute(options.weights).string();
  PythonChild child;
  child.python = options.python;
  child.module = "export_model";
  child.what = "kiln model import";
  child.python_hint = "torch (and transformers for --hf)";
  json manifest = run_python_child(child, spec).at("manifest");
  // The unit list found in Python must split the graph kiln runs; where it does not, the package
  // keeps no units (package.json says why) or, for a --units the user gave, the import fails.
  if (manifest.value("units", json()).is_object()) {
    const fs::path dir = options.out;
    const json& graphs = manifest.at("graphs");
    ExportedGraph graph(json::parse(read_file(dir / graphs[0].at("file").get<std::string>())),
                        (dir / graphs[0].at("file").get<std::string>()).string());
    if (std::string problem = split_package_units(graph, manifest); !problem.empty()) {
      const std::string units = manifest["units"].value("prefix", "");
      manifest["units"] = nullptr;
      manifest["units_problem"] = fmt::format("{}: {}", units, problem);
      write_file_atomic(dir / "package.json", manifest.dump(2) + "\n");
      if (!options.units.empty()) {
        throw UserError(fmt::format(
            "kiln model import --units {}: {}; the package in {} was written without units "
            "(give another --units, or --units none)",
            options.units, problem, dir.string()));
      }
    }
  }
  return manifest;
}

std::string inspect_package(const fs::path& dir) {
  const json manifest = read_package(dir, "package", true);
  const auto graph = load_graph(dir, manifest);
  const GraphMath math = graph->math();
  std::ostringstream out;
  const json& source = manifest["source"];
  out << fmt::format("package {} (format {})\n", fs::absolute(dir).lexically_normal().string(),
                     manifest.value("format_version", 0));
  if (source.value("kind", "") == "hf") {
    out << fmt::format("source: Hugging Face {} ({}), {}\n", source.value("model_type", "?"),
                       source.value("architectures", json::array()).dump(),
                       source.value("path", "?"));
  } else {
    out << fmt::format("source: {} with options {} (sha256 {})\n", source.value("module", "?"),
                       source.value("options", json::object()).dump(),
                       source.value("sha256", "?").substr(0, 16));
  }
  out << "versions:";
  for (const auto& [name, version] : manifest["versions"].items()) {
    out << " " << name << " " << version.get<std::string>();
  }
  out << "\n";
  const json& input = manifest["input"];
  out << fmt::format("input: token ids [batch, seq] int64, vocabulary {}; batch in {}, seq in {}\n",
                     input.value("vocab_size", int64_t{0}),
                     input["dims"].value("batch", json::array()).dump(),
                     input["dims"].value("seq", json::array()).dump());
  const json& g = manifest["graphs"][0];
  out << fmt::format("graph forward: {} nodes ({} run by kiln), {} operators, sha256 {}\n",
                     g.value("nodes", 0), graph->node_count(), g["ops"].size(),
                     g.value("sha256", "").substr(0, 16));
  std::string ops;
  for (const json& op : g["ops"]) {
    std::string name = op.get<std::string>();
    if (name.rfind("torch.ops.", 0) == 0) name = name.substr(10);
    ops += (ops.empty() ? "" : ", ") + name;
  }
  out << "  " << ops << "\n";
  int64_t parameters = 0, buffers = 0;
  for (const GraphInput& in : graph->inputs()) {
    parameters += in.kind == GraphInput::Kind::kParameter;
    buffers += in.kind == GraphInput::Kind::kBuffer || in.kind == GraphInput::Kind::kConstant;
  }
  out << fmt::format(
      "weights: {} parameters ({} tensors), {} buffers/constants; FLOP (6N) parameters {}, "
      "attention "
      "layers {} (width {})\n",
      math.parameters, parameters, buffers, math.flop_parameters, math.attention_layers,
      math.attention_width);
  if (const auto& units = graph->units(); !units.empty()) {
    int64_t least = INT64_MAX, most = 0;
    for (const GraphUnit& unit : units) {
      least = std::min(least, unit.elements);
      most = std::max(most, unit.elements);
    }
    out << fmt::format("units: {} x {} ({} .. {}), {} to {} parameters each\n",
                       manifest["units"].value("prefix", ""), units.size(), units.front().name,
                       units.back().name, least, most);
  } else {
    out << fmt::format("units: none ({}); activation checkpointing and FSDP take the model whole\n",
                       manifest.value("units_problem", std::string("imported with --units none or "
                                                                   "no module list")));
  }
  out << fmt::format("train with --set model.name=exported --set model.package={}\n",
                     fs::absolute(dir).lexically_normal().string());
  return out.str();
}

void set_exported_no_grad_op_for_test(Model& model, const std::string& target) {
  dynamic_cast<ExportedModel&>(model).graph_for_test().set_no_grad_op_for_test(target);
}

ModelSpec exported_spec() {
  ModelSpec spec;
  spec.name = "exported";
  spec.description =
      "a PyTorch model exported by `kiln model import` (model.package), its graph run from C++";
  spec.input = ModelInput::kTokens;
  spec.python_twin = "kiln_py.models";  // kiln_py.exported_twin: the package's own graph
  spec.build = [](const Config& config, at::Generator&) -> std::shared_ptr<Model> {
    const fs::path dir = ModelBuildOptions::from_config(config).package;
    json manifest = read_package(dir, "model.package", true);
    auto graph = load_graph(dir, manifest);
    return std::make_shared<ExportedModel>(dir, std::move(manifest), std::move(graph));
  };
  spec.vocab_size = [](const Config& config) -> int64_t {
    json manifest;
    if (!package_problem(config, &manifest).empty()) return 0;
    return manifest["input"].value("vocab_size", int64_t{0});
  };
  spec.math = [](const Config& config) {
    const fs::path dir = ModelBuildOptions::from_config(config).package;
    const json manifest = read_package(dir, "model.package", false);
    const auto graph = load_graph(dir, manifest);
    const GraphMath g = graph->math();
    ModelMath math;
    math.parameters = g.parameters;
    // The largest unit, or the root group (what no unit holds) if larger.
    int64_t root = g.parameters, largest = 0;
    for (const GraphUnit& unit : graph->units()) {
      root -= unit.elements;
      largest = std::max(largest, unit.elements);
    }
    math.largest_unit_parameters = std::max(largest, root);
    math.flop_parameters = g.flop_parameters;
    math.n_layer = g.attention_layers;
    math.attention_width = g.attention_width;
    math.vocab_size = manifest["input"].value("vocab_size", int64_t{0});
    math.block_size = manifest["input"]["dims"].value("seq", json::array({0, 0})).at(1);
    return math;
  };
  spec.keys = {string_key("model", "package", "", {},
                          "exported: the directory `kiln model import` wrote (package.json, the "
                          "graph, the initial weights; docs/models.md)")};
  spec.rules = {
      {"exported: model.package names a package this kiln reads, data.seq_len is inside "
       "its exported sequence range, and a compiled step is one graph (no per-unit compilation)",
       [](const Config& c) -> std::string {
         if (!is_exported(c)) return "";
         const ModelBuildOptions options = ModelBuildOptions::from_config(c);
         if (options.package.empty()) {
           return "model.name = \"exported\" needs model.package = DIR, a package written by "
                  "`kiln model import --out DIR`";
         }
         json manifest;
         if (std::string problem = package_problem(c, &manifest); !problem.empty()) return problem;
         if (options.compiled && options.compiled_per_unit) {
           return "model.name = \"exported\" with compile.granularity resolving to \"unit\" "
                  "(train.activation_checkpointing or dist.strategy = \"fsdp\" ask it): an "
                  "exported package compiles as one whole-step graph only; set "
                  "compile.granularity = \"step\" with train.activation_checkpointing = "
                  "\"none\" and no FSDP, or compile.backend = \"eager\"";
         }
         if (options.compiled) {
           if (std::string buffer = written_buffer(options.package, manifest); !buffer.empty()) {
             return fmt::format(
                 "model.package = \"{}\" writes buffer '{}' in its forward, and a compiled "
                 "step binds buffers read-only; set compile.backend = \"eager\"",
                 options.package, buffer);
           }
         }
         const json seq = manifest["input"]["dims"].value("seq", json::array({2, 0}));
         const int64_t seq_len = options.seq_len;
         if (seq_len >= seq.at(0).get<int64_t>() && seq_len <= seq.at(1).get<int64_t>()) return "";
         return fmt::format(
             "data.seq_len = {} is outside the sequence range [{}, {}] model.package "
             "= \"{}\" was exported for; lower data.seq_len or re-import with "
             "--max-seq {}",
             seq_len, seq.at(0).get<int64_t>(), seq.at(1).get<int64_t>(), options.package, seq_len);
       },
       {"model.name=exported", "data.name=text", "model.package=/nonexistent/package"}},
  };
  return spec;
}

}  // namespace kiln
