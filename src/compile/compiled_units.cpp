// Per-unit compilation (compile.granularity = "unit"): each Model::units() entry runs through a
// forward and a backward AOTInductor package (built by python/kiln_py/compile_units.py), inside
// an autograd function, as the innermost UnitWrapper, so activation checkpointing and FSDP's
// gather/free wrap compiled units exactly as they wrap eager ones.
//
// The autograd function's inputs are the unit's input and its parameters (the model's own
// tensors, read at call time: FSDP's gathered storage, its param_dtype), so the gradients the
// backward package returns land on them through the graph's AccumulateGrad nodes and FSDP's
// gradient hooks fire as in eager. The forward package returns the output and the saved tensors
// the backward package takes; saved tensors that are inputs (a parameter, the unit's input) are
// kiln's own tensors, saved by autograd (FSDP regathers a freed parameter before the backward).
#include "compile/compiled_units.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <map>

#include "compile/compiler_run.h"
#include "core/clock.h"
#include "core/files.h"
#include "core/process.h"
#include "core/strings.h"
#include "kiln/build_info.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

namespace compiled_units_impl {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The package pair of one unit structure and input signature.
struct UnitPair {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> forward, backward;
  // Each saved tensor the backward takes, in order: an argument of the unit (0 the input,
  // 1 + j parameter j) or an output of the forward package (0 is the unit's output).
  struct Saved {
    bool argument = false;
    size_t index = 0;
  };
  std::vector<Saved> saved;
  std::vector<size_t> gradients;  // backward output k is the gradient of argument gradients[k]
  size_t forward_outputs = 1;
  bool eager = false;  // graph breaks, compile.fullgraph = false
};

// Autocast would re-cast inside the packages' ATen fallbacks: the autocast policy is already in
// the graphs, so it is off while a package runs.
struct NoAutocastInPackage {
  c10::impl::ExcludeDispatchKeyGuard guard{
      c10::DispatchKeySet({c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA})};
};

std::vector<torch::Tensor> run_forward(const UnitPair& pair, const torch::Tensor& input,
                                       at::TensorList parameters) {
  std::vector<torch::Tensor> args = {input.contiguous()};
  args.insert(args.end(), parameters.begin(), parameters.end());
  NoAutocastInPackage no_autocast;
  std::vector<torch::Tensor> outs = pair.forward->run(args);
  if (outs.size() != pair.forward_outputs) {
    throw std::logic_error(fmt::format("a unit's forward package returned {} tensors, not {}",
                                       outs.size(), pair.forward_outputs));
  }
  return outs;
}

struct PairHolder : torch::CustomClassHolder {
  const UnitPair* pair = nullptr;
};

class CompiledUnitFunction : public torch::autograd::Function<CompiledUnitFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<PairHolder> holder,
                               const torch::Tensor& input, at::TensorList parameters) {
    const UnitPair& pair = *holder->pair;
    std::vector<torch::Tensor> outs = run_forward(pair, input, parameters);
    variable_list saved;
    saved.reserve(pair.saved.size());
    for (const UnitPair::Saved& s : pair.saved) {
      if (!s.argument) {
        saved.push_back(outs[s.index]);
      } else if (s.index == 0) {
        saved.push_back(input);
      } else {
        saved.push_back(parameters[s.index - 1]);
      }
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["pair"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["parameters"] = static_cast<int64_t>(parameters.size());
    return outs[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto holder =
        c10::static_intrusive_pointer_cast<PairHolder>(ctx->saved_data["pair"].toCapsule());
    const UnitPair& pair = *holder->pair;
    std::vector<torch::Tensor> args = ctx->get_saved_variables();
    torch::Tensor grad = grad_outputs[0];
    args.push_back(grad.contiguous());
    std::vector<torch::Tensor> grads;
    {
      NoAutocastInPackage no_autocast;
      grads = pair.backward->run(args);
    }
    const auto parameters = static_cast<size_t>(ctx->saved_data["parameters"].toInt());
    variable_list out(2 + parameters);  // [0]: the pair capsule, [1]: input, [2..]: parameters
    for (size_t k = 0; k < grads.size() && k < pair.gradients.size(); ++k) {
      out[1 + pair.gradients[k]] = grads[k];
    }
    return out;
  }
};

std::string dtype_name(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat:
      return "float32";
    case torch::kBFloat16:
      return "bfloat16";
    case torch::kHalf:
      return "float16";
    default:
      return c10::toString(type);
  }
}

class CompiledUnits final : public UnitWrapper {
 public:
  CompiledUnits(const CompileOptions& options, TrainOptions::Precision precision, Model& model,
                torch::Device device, const PackageCache& cache, json model_json,
                CompileReport& report)
      : options_(options),
        precision_(precision),
        device_(device),
        cache_(cache),
        model_json_(std::move(model_json)),
        report_(report),
        units_(model.units()) {
    std::map<std::string, torch::Tensor> by_name;
    for (const auto& item : model.named_parameters()) by_name.emplace(item.key(), item.value());
    for (const ModelUnit& unit : units_) {
      auto& list = parameters_.emplace_back();
      auto& names = relative_names_.emplace_back();
      for (const std::string& name : unit.parameters) {
        auto it = by_name.find(name);
        if (it == by_name.end()) {
          throw std::logic_error(
              fmt::format("model unit {} names parameter {}, which the model "
                          "does not have",
                          unit.name, name));
        }
        list.push_back(it->second);
        names.push_back(name.starts_with(unit.name + ".") ? name.substr(unit.name.size() + 1)
                                                          : name);
      }
    }
    per_unit_.resize(units_.size());
  }

  torch::Tensor run(int unit, const UnitForward& forward, const torch::Tensor& input) override {
    const auto u = static_cast<size_t>(unit);
    if (u >= units_.size() || !autocast_matches(input)) return forward(input);
    const UnitPair* pair = resolve(u, input);
    if (pair == nullptr || pair->eager) {
      ++report_.eager_unit_calls;
      return forward(input);
    }
    const at::TensorList parameters(parameters_[u]);
    ++report_.compiled_unit_forwards;
    if (!torch::GradMode::is_enabled()) return run_forward(*pair, input, parameters)[0];
    auto holder = c10::make_intrusive<PairHolder>();
    holder->pair = pair;
    return CompiledUnitFunction::apply(holder, input, parameters);
  }

 private:
  // The packages trace train.precision's autocast: run them only under that state.
  bool autocast_matches(const torch::Tensor& input) const {
    const c10::DeviceType type = input.device().type();
    const bool enabled = at::autocast::is_autocast_enabled(type);
    switch (precision_) {
      case TrainOptions::Precision::kFp32:
        return !enabled;
      case TrainOptions::Precision::kBf16Mixed:
        return enabled && at::autocast::get_autocast_dtype(type) == at::kBFloat16;
      case TrainOptions::Precision::kFp16Mixed:
        return enabled && at::autocast::get_autocast_dtype(type) == at::kHalf;
    }
    return false;
  }

  // The unit's structure and this call's signature: what a package pair depends on.
  json signature(size_t u, const torch::Tensor& input) const {
    json parameters = json::array();
    for (size_t k = 0; k < parameters_[u].size(); ++k) {
      const torch::Tensor& p = parameters_[u][k];
      parameters.push_back({{"name", relative_names_[u][k]},
                            {"shape", p.sizes().vec()},
                            {"dtype", dtype_name(p.scalar_type())}});
    }
    return {{"input", {{"shape", input.sizes().vec()}, {"dtype", dtype_name(input.scalar_type())}}},
            {"parameters", parameters}};
  }

  Fingerprint fingerprint(const CompilerPython& python, const json& sig, const char* graph) const {
    return {json{
        {"kiln", build_info().version},
        {"torch", python.torch_version},
        {"torch_git", python.torch_git},
        {"compiler_script", python.script_hash},
        {"device", device_.is_cuda() ? "cuda" : "cpu"},
        {"arch", cpu_model()},
        {"model", model_json_},
        {"graph", graph},
        {"unit", sig},
        {"precision", precision_name(precision_)},
        {"deterministic", at::globalContext().deterministicAlgorithms()},
    }};
  }

  const UnitPair* resolve(size_t u, const torch::Tensor& input) {
    const json sig = signature(u, input);
    const std::string key = sig.dump();
    auto& seen = per_unit_[u];
    if (auto it = seen.find(key); it != seen.end()) return it->second;
    const bool shared = pairs_.count(key) > 0;
    if (!shared && static_cast<int>(pairs_.size()) >= options_.recompile_limit) {
      log::warn(
          fmt::format("compile: unit {} with input {}: over compile.recompile_limit = {}, "
                      "runs eager",
                      units_[u].name, describe_input(input), options_.recompile_limit));
      seen[key] = nullptr;
      return nullptr;
    }
    if (!seen.empty()) ++report_.unit_recompiles;
    CompileReport::UnitGraph entry;
    entry.unit = units_[u].name;
    entry.input = describe_input(input);
    if (shared) {
      entry.shared = true;
      entry.cache_hit = true;
      entry.forward_package = pair_packages_[key].first;
      entry.backward_package = pair_packages_[key].second;
      entry.eager = pairs_[key]->eager;
    } else {
      pairs_[key] = load(u, sig, entry);
      pair_packages_[key] = {entry.forward_package, entry.backward_package};
    }
    report_.unit_graphs.push_back(entry);
    seen[key] = pairs_[key].get();
    return seen[key];
  }

  static std::string describe_input(const torch::Tensor& input) {
    std::string dims;
    for (int64_t d : input.sizes()) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    return dtype_name(input.scalar_type()) + " [" + dims + "]";
  }

  std::unique_ptr<UnitPair> load(size_t u, const json& sig, CompileReport::UnitGraph& entry);

  CompileOptions options_;
  TrainOptions::Precision precision_;
  torch::Device device_;
  PackageCache cache_;
  json model_json_;
  CompileReport& report_;
  std::vector<ModelUnit> units_;
  std::vector<std::vector<torch::Tensor>> parameters_;      // per unit: the model's own tensors
  std::vector<std::vector<std::string>> relative_names_;    // per unit: names inside the unit
  std::map<std::string, std::unique_ptr<UnitPair>> pairs_;  // by signature
  std::map<std::string, std::pair<std::string, std::string>> pair_packages_;
  std::vector<std::map<std::string, const UnitPair*>> per_unit_;  // null: runs eager
};

std::unique_ptr<UnitPair> CompiledUnits::load(size_t u, const json& sig,
                                              CompileReport::UnitGraph& entry) {
  const CompilerPython& python = CompilerPython::probe(options_.python);
  const Fingerprint forward_key = fingerprint(python, sig, "unit-forward");
  const Fingerprint backward_key = fingerprint(python, sig, "unit-backward");
  PackageCache::BuildLock lock(cache_, forward_key);  // one builder across processes
  std::string why_not;
  std::optional<PackageCache::Hit> forward = cache_.find(forward_key, &why_not);
  std::optional<PackageCache::Hit> backward;
  if (forward) backward = cache_.find(backward_key, &why_not);
  entry.cache_hit = forward && backward;
  if (!entry.cache_hit) {
    entry.cache_note = why_not;
    log::info(fmt::format(
        "compile: building unit {}'s forward and backward for input {} with "
        "AOTInductor ({}; cache {}: {})",
        units_[u].name, entry.input, python.torch_version, cache_.dir().string(), why_not));
    const auto begin = SteadyClock::now();
    const fs::path scratch = cache_.scratch_dir(forward_key);
    const json spec = {
        {"model", model_json_},
        {"graph", "unit"},
        {"unit", units_[u].name},
        {"input", sig["input"]},
        {"parameters", sig["parameters"]},
        {"package", (scratch / "forward.pt2").string()},
        {"backward_package", (scratch / "backward.pt2").string()},
    };
    const std::string what = "unit " + units_[u].name;
    const CompilerRun run = run_compiler(python, scratch, spec, device_, precision_, what);
    if (run.graph_breaks()) {
      const std::vector<GraphBreak> breaks = run.breaks();
      report_.breaks.insert(report_.breaks.end(), breaks.begin(), breaks.end());
      if (options_.fullgraph) {
        throw TrainingError(fmt::format(
            "compile.fullgraph = true and unit {} has {} graph break(s): {}; remove them from "
            "the model, or set compile.fullgraph = false to run that unit eager",
            units_[u].name, breaks.size(), describe_breaks(breaks)));
      }
      log::warn(
          fmt::format("compile: unit {} has {} graph break(s), so it runs eager "
                      "(compile.fullgraph = false): {}",
                      units_[u].name, breaks.size(), describe_breaks(breaks)));
      auto pair = std::make_unique<UnitPair>();
      pair->eager = true;
      entry.eager = true;
      return pair;
    }
    run.check_built(what);
    const json& result = run.result;
    backward = cache_.publish(backward_key, scratch / "backward.pt2", result);
    forward = cache_.publish(forward_key, scratch / "forward.pt2", result);
    std::error_code ec;
    fs::remove_all(scratch, ec);
    entry.build_seconds = seconds_since(begin);
  }
  const auto load_begin = SteadyClock::now();
  const json& report = forward->record["report"];
  auto pair = std::make_unique<UnitPair>();
  const auto device_index = device_.is_cuda() ? device_.index() : static_cast<c10::DeviceIndex>(-1);
  pair->forward = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
      forward->package.string(), "model", false, 1, device_index);
  pair->backward = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
      backward->package.string(), "model", false, 1, device_index);
  // The pair's calling convention from its build record, checked against this unit.
  const size_t arguments = 1 + parameters_[u].size();
  try {
    pair->forward_outputs = report.at("forward_outputs").get<size_t>();
    for (const json& s : report.at("saved")) {
      const bool argument = s.contains("input");
      const size_t index = (argument ? s.at("input") : s.at("output")).get<size_t>();
      if (index >= (argument ? arguments : pair->forward_outputs)) throw std::out_of_range("saved");
      pair->saved.push_back({argument, index});
    }
    for (const json& g : report.at("gradients")) {
      if (g.get<size_t>() >= arguments) throw std::out_of_range("gradient");
      pair->gradients.push_back(g.get<size_t>());
    }
  } catch (const std::exception& e) {
    throw UserError(
        fmt::format("the compiled unit package {} has a malformed record ({}); "
                    "remove it from compile.cache_dir",
                    forward->package.string(), e.what()));
  }
  entry.load_seconds = seconds_since(load_begin);
  entry.forward_package = forward->package.string();
  entry.backward_package = backward->package.string();
  log::info(fmt::format(
      "compile: unit {} for input {}: {} (load {:.2f} s)", units_[u].name, entry.input,
      entry.cache_hit ? "cached packages" : fmt::format("built in {:.1f} s", entry.build_seconds),
      entry.load_seconds));
  return pair;
}

}  // namespace compiled_units_impl

std::shared_ptr<UnitWrapper> make_compiled_units(const CompileOptions& options,
                                                 TrainOptions::Precision precision, Model& model,
                                                 torch::Device device, const PackageCache& cache,
                                                 const json& model_json, CompileReport& report) {
  return std::make_shared<compiled_units_impl::CompiledUnits>(options, precision, model, device,
                                                              cache, model_json, report);
}

}  // namespace kiln
