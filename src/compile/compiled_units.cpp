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
//
// With compile.root, the model's root runs the same way, as two pieces around the units
// (src/models/split_forward.h): "root.before_units" (gpt: token and position embeddings, from
// the token ids) and "root.after_units" (final norm, head and loss, from the last unit's output
// and the targets), each a forward and backward package pair in the same autograd function, the
// units (and their wrappers) running between them from root_loss().
//
// Cold, each pair would build when its piece first runs, one compiler process after another.
// With the root compiled, compile.jobs >= 2 and one process, the first root_loss whose first
// piece is not cached runs the model's forward once eagerly without gradients (the random
// generator's state kept) to find every piece's signature, then builds the missing pairs side by
// side, each in its own compiler process, as the whole step's train and eval graphs build; the
// step then loads them from the cache as usual.
#include "compile/compiled_units.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <future>
#include <map>
#include <set>

#include "compile/compiler_run.h"
#include "compile/unit_function.h"
#include "core/clock.h"
#include "core/files.h"
#include "core/process.h"
#include "core/strings.h"
#include "kiln/build_info.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "models/split_forward.h"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

namespace compiled_units_impl {

std::string dtype_name(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat:
      return "float32";
    case torch::kBFloat16:
      return "bfloat16";
    case torch::kHalf:
      return "float16";
    case torch::kLong:
      return "int64";
    default:
      return c10::toString(type);
  }
}

json tensor_signature(const torch::Tensor& t) {
  return {{"shape", t.sizes().vec()}, {"dtype", dtype_name(t.scalar_type())}};
}

// What runs through one pair: a unit, or one of the root's two pieces.
struct Piece {
  std::string name;                       // "transformer.h.0", "root.before_units", ...
  bool root = false;                      // names its parameters in full, not inside the unit
  std::vector<torch::Tensor> parameters;  // the model's own tensors
  std::vector<std::string> names;         // inside the unit (a root piece: full names)
};

class CompiledUnits final : public CompiledUnitWrapper {
 public:
  CompiledUnits(const CompileOptions& options, TrainOptions::Precision precision, bool compile_root,
                Model& model, torch::Device device, const PackageCache& cache, json model_json,
                CompileReport& report)
      : options_(options),
        precision_(precision),
        device_(device),
        cache_(cache),
        model_json_(std::move(model_json)),
        report_(report),
        model_(model),
        split_(compile_root ? split_forward_of(model) : nullptr) {
    std::map<std::string, torch::Tensor> by_name;
    for (const auto& item : model.named_parameters()) by_name.emplace(item.key(), item.value());
    auto add = [&](const std::string& name, bool root, const std::vector<std::string>& params) {
      Piece& piece = pieces_.emplace_back();
      piece.name = name;
      piece.root = root;
      for (const std::string& param : params) {
        auto it = by_name.find(param);
        if (it == by_name.end()) {
          throw std::logic_error(fmt::format(
              "model piece {} names parameter {}, which the model does not have", name, param));
        }
        piece.parameters.push_back(it->second);
        piece.names.push_back(!root && param.starts_with(name + ".") ? param.substr(name.size() + 1)
                                                                     : param);
      }
    };
    for (const ModelUnit& unit : model.units()) add(unit.name, false, unit.parameters);
    units_ = pieces_.size();
    if (split_) {
      add("root.before_units", true, split_->before_units_parameters());
      add("root.after_units", true, split_->after_units_parameters());
    }
    per_piece_.resize(pieces_.size());
  }

  torch::Tensor run(int unit, const UnitForward& forward, const torch::Tensor& input) override {
    const auto u = static_cast<size_t>(unit);
    if (discovering_) {  // prebuild(): the signature, and the eager unit
      if (u < units_ && autocast_matches(input)) discovered_.emplace_back(u, signature(u, {input}));
      return forward(input);
    }
    if (u >= units_ || !autocast_matches(input)) return forward(input);
    const UnitPair* pair = resolve(u, {input});
    if (pair == nullptr || pair->eager) {
      ++report_.eager_unit_calls;
      return forward(input);
    }
    ++report_.compiled_unit_forwards;
    return call(u, *pair, {input});
  }

  bool compiles_root() const override { return split_ != nullptr; }

  torch::Tensor root_loss(const torch::Tensor& inputs, const torch::Tensor& targets) override {
    if (!split_) throw std::logic_error("root_loss without a compiled root");
    const size_t before = units_, after = units_ + 1;
    const bool compiled = autocast_matches(inputs) && within_block_size(inputs);
    if (compiled && !prebuild_done_) prebuild(inputs, targets);
    const UnitPair* pair = compiled ? resolve(before, {inputs}) : nullptr;
    torch::Tensor hidden = pair == nullptr || pair->eager ? split_->before_units(inputs)
                                                          : call(before, *pair, {inputs});
    hidden = split_->through_units(hidden);
    pair = compiled ? resolve(after, {hidden, targets}) : nullptr;
    if (pair == nullptr || pair->eager) return model_.loss(split_->after_units(hidden), targets);
    return call(after, *pair, {hidden, targets});
  }

 private:
  // The piece's output: through the autograd function (its backward runs the backward package)
  // when a gradient is being recorded, else the forward package alone.
  torch::Tensor call(size_t p, const UnitPair& pair, std::vector<torch::Tensor> arguments) {
    const auto leading = static_cast<int64_t>(arguments.size());
    // Contiguous as the package reads them, and as the backward gets them when they are saved.
    for (torch::Tensor& t : arguments) t = t.contiguous();
    arguments.insert(arguments.end(), pieces_[p].parameters.begin(), pieces_[p].parameters.end());
    if (!torch::GradMode::is_enabled()) {
      return run_forward(pair, arguments, static_cast<size_t>(leading))[0];
    }
    auto holder = c10::make_intrusive<PairHolder>();
    holder->pair = &pair;
    return CompiledUnitFunction::apply(holder, at::TensorList(arguments), leading);
  }

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

  // A sequence over the model's block size runs the eager piece, which refuses it.
  bool within_block_size(const torch::Tensor& inputs) const {
    const int64_t block = model_json_.value("block_size", int64_t{0});
    return block == 0 || inputs.dim() < 2 || inputs.size(1) <= block;
  }

  // The piece's structure and this call's signature: what a package pair depends on.
  json signature(size_t p, const std::vector<torch::Tensor>& leading) const {
    const Piece& piece = pieces_[p];
    json parameters = json::array();
    for (size_t k = 0; k < piece.parameters.size(); ++k) {
      json t = tensor_signature(piece.parameters[k]);
      t["name"] = piece.names[k];
      parameters.push_back(t);
    }
    json sig = {{"input", tensor_signature(leading[0])}, {"parameters", parameters}};
    if (leading.size() > 1) sig["targets"] = tensor_signature(leading[1]);
    if (piece.root) sig["piece"] = piece.name;
    return sig;
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

  const UnitPair* resolve(size_t p, const std::vector<torch::Tensor>& leading) {
    const json sig = signature(p, leading);
    const std::string key = sig.dump();
    auto& seen = per_piece_[p];
    if (auto it = seen.find(key); it != seen.end()) return it->second;
    const bool shared = pairs_.count(key) > 0;
    // The limit counts the units' pairs together (they share them) and each root piece's own.
    size_t built = unit_pairs_;
    if (pieces_[p].root) {
      built = static_cast<size_t>(std::count_if(seen.begin(), seen.end(),
                                                [](const auto& s) { return s.second != nullptr; }));
    }
    if (!shared && static_cast<int64_t>(built) >= options_.recompile_limit) {
      log::warn(
          fmt::format("compile: {} with input {}: over compile.recompile_limit = {}, runs "
                      "eager",
                      what(p), describe_input(leading[0]), options_.recompile_limit));
      seen[key] = nullptr;
      return nullptr;
    }
    if (!seen.empty()) ++report_.unit_recompiles;
    CompileReport::UnitGraph entry;
    entry.unit = pieces_[p].name;
    entry.input = describe_input(leading[0]);
    if (shared) {
      entry.shared = true;
      entry.cache_hit = true;
      entry.forward_package = pair_packages_[key].first;
      entry.backward_package = pair_packages_[key].second;
      entry.eager = pairs_[key]->eager;
    } else {
      pairs_[key] = load(p, sig, leading.size(), entry);
      pair_packages_[key] = {entry.forward_package, entry.backward_package};
      if (!pieces_[p].root) ++unit_pairs_;
    }
    report_.unit_graphs.push_back(entry);
    seen[key] = pairs_[key].get();
    return seen[key];
  }

  std::string what(size_t p) const {
    return (pieces_[p].root ? "root piece " : "unit ") + pieces_[p].name;
  }

  static std::string describe_signature(const json& tensor) {
    std::string dims;
    for (const json& d : tensor.at("shape")) dims += (dims.empty() ? "" : ", ") + d.dump();
    return tensor.at("dtype").get<std::string>() + " [" + dims + "]";
  }

  static std::string describe_input(const torch::Tensor& input) {
    std::string dims;
    for (int64_t d : input.sizes()) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    return dtype_name(input.scalar_type()) + " [" + dims + "]";
  }

  bool cached(const CompilerPython& python, const json& sig) const {
    return cache_.find(fingerprint(python, sig, "unit-forward"), nullptr).has_value() &&
           cache_.find(fingerprint(python, sig, "unit-backward"), nullptr).has_value();
  }

  // The file comment's side-by-side build of the pieces' pairs, once, before the first step's
  // forward (nothing when warm, when compile.jobs = 1 or under several processes).
  void prebuild(const torch::Tensor& inputs, const torch::Tensor& targets) {
    prebuild_done_ = true;
    if (options_.jobs < 2 || !options_.prebuild_pieces) return;
    const size_t before = units_, after = units_ + 1;
    const CompilerPython& python = CompilerPython::probe(options_.python);
    const json first = signature(before, {inputs});
    if (cached(python, first)) return;
    discovered_.clear();
    discovered_.emplace_back(before, first);
    {
      // The eager forward must not move the random stream (dropout): a cold run trains as a
      // warm one, bit for bit.
      at::Generator generator = at::globalContext().defaultGenerator(device_);
      at::Tensor state;
      {
        std::lock_guard<std::mutex> lock(generator.mutex());
        state = generator.get_state();
      }
      torch::NoGradGuard no_grad;
      discovering_ = true;
      try {
        torch::Tensor hidden = split_->through_units(split_->before_units(inputs));
        discovered_.emplace_back(after, signature(after, {hidden, targets}));
      } catch (...) {
        discovering_ = false;
        throw;
      }
      discovering_ = false;
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    }
    std::vector<std::pair<size_t, json>> todo;
    std::set<std::string> seen;
    for (const auto& [p, sig] : discovered_) {
      if (seen.insert(sig.dump()).second && !cached(python, sig)) todo.emplace_back(p, sig);
    }
    discovered_.clear();
    if (todo.size() < 2) return;  // nothing to overlap: the step builds it as it runs
    const size_t workers = std::min(todo.size(), static_cast<size_t>(options_.jobs));
    std::string names;
    for (const auto& item : todo) names += (names.empty() ? "" : ", ") + what(item.first);
    log::info(
        fmt::format("compile: building {} pieces' packages side by side, {} at a time "
                    "(compile.jobs): {}",
                    todo.size(), workers, names));
    const int threads = at::get_num_threads();  // per thread under OpenMP: read it here
    std::vector<PairBuild> built(todo.size());
    std::vector<std::exception_ptr> errors(todo.size());
    std::atomic<size_t> next{0};
    std::vector<std::future<void>> pool;
    for (size_t w = 0; w < workers; ++w) {
      pool.push_back(std::async(std::launch::async, [&] {
        for (size_t i = next++; i < todo.size(); i = next++) {
          try {
            built[i] = build_missing(todo[i].first, todo[i].second, threads, /*isa_probe=*/i == 0);
          } catch (...) {
            errors[i] = std::current_exception();
          }
        }
      }));
    }
    for (auto& worker : pool) worker.get();
    for (const std::exception_ptr& error : errors) {
      if (error) std::rethrow_exception(error);
    }
    for (size_t i = 0; i < todo.size(); ++i) prebuilt_[todo[i].second.dump()] = built[i];
  }

  // One compiler run for piece p's pair, published to the cache (unless the piece has graph
  // breaks). `threads`: the compiler's thread count (read on the training thread).
  struct PairBuild {
    bool ran = false;  // false: another process had built it
    bool breaks = false;
    std::vector<GraphBreak> graph_breaks;
    double seconds = 0;
  };
  PairBuild build_missing(size_t p, const json& sig, int threads, bool isa_probe) const {
    const CompilerPython& python = CompilerPython::probe(options_.python);
    const Fingerprint forward_key = fingerprint(python, sig, "unit-forward");
    const Fingerprint backward_key = fingerprint(python, sig, "unit-backward");
    PackageCache::BuildLock lock(cache_, forward_key);  // one builder across processes
    std::string why_not;
    if (cache_.find(forward_key, &why_not) && cache_.find(backward_key, &why_not)) return {};
    return build(p, sig, forward_key, backward_key, why_not, threads, isa_probe);
  }

  PairBuild build(size_t p, const json& sig, const Fingerprint& forward_key,
                  const Fingerprint& backward_key, const std::string& why_not, int threads,
                  bool isa_probe) const {
    const CompilerPython& python = CompilerPython::probe(options_.python);
    log::info(
        fmt::format("compile: building {}'s forward and backward for input {} with "
                    "AOTInductor ({}; cache {}: {})",
                    what(p), describe_signature(sig["input"]), python.torch_version,
                    cache_.dir().string(), why_not));
    const auto begin = SteadyClock::now();
    const fs::path scratch = cache_.scratch_dir(forward_key);
    json spec = {
        {"model", model_json_},
        {"graph", "unit"},
        {"unit", pieces_[p].name},
        {"input", sig["input"]},
        {"parameters", sig["parameters"]},
        {"package", (scratch / "forward.pt2").string()},
        {"backward_package", (scratch / "backward.pt2").string()},
        {"threads", threads},
    };
    if (sig.contains("targets")) spec["targets"] = sig["targets"];
    if (!isa_probe) spec["isa_probe"] = false;  // one process runs the ISA checks' child
    const CompilerRun run = run_compiler(python, scratch, spec, device_, precision_, what(p));
    PairBuild out;
    out.ran = true;
    if (run.graph_breaks()) {
      out.breaks = true;
      out.graph_breaks = run.breaks();
    } else {
      run.check_built(what(p));
      cache_.publish(backward_key, scratch / "backward.pt2", run.result);
      cache_.publish(forward_key, scratch / "forward.pt2", run.result);
      std::error_code ec;
      fs::remove_all(scratch, ec);
    }
    out.seconds = seconds_since(begin);
    return out;
  }

  std::unique_ptr<UnitPair> load(size_t p, const json& sig, size_t leading,
                                 CompileReport::UnitGraph& entry);

  CompileOptions options_;
  TrainOptions::Precision precision_;
  torch::Device device_;
  PackageCache cache_;
  json model_json_;
  CompileReport& report_;
  Model& model_;
  SplitForward* split_;        // null: the root runs eager (compile.root = false, or no split)
  std::vector<Piece> pieces_;  // the units in order, then the root's two pieces (with split_)
  size_t units_ = 0;
  size_t unit_pairs_ = 0;                                   // pairs built or loaded for units
  std::map<std::string, std::unique_ptr<UnitPair>> pairs_;  // by signature
  std::map<std::string, std::pair<std::string, std::string>> pair_packages_;
  std::vector<std::map<std::string, const UnitPair*>> per_piece_;  // null: runs eager
  bool prebuild_done_ = false;  // prebuild() ran (once, at the first root_loss)
  bool discovering_ = false;    // prebuild()'s eager forward: run() records signatures
  std::vector<std::pair<size_t, json>> discovered_;
  std::map<std::string, PairBuild> prebuilt_;  // by signature: what prebuild() built
};

std::unique_ptr<UnitPair> CompiledUnits::load(size_t p, const json& sig, size_t leading,
                                              CompileReport::UnitGraph& entry) {
  const Piece& piece = pieces_[p];
  const CompilerPython& python = CompilerPython::probe(options_.python);
  const Fingerprint forward_key = fingerprint(python, sig, "unit-forward");
  const Fingerprint backward_key = fingerprint(python, sig, "unit-backward");
  PackageCache::BuildLock lock(cache_, forward_key);  // one builder across processes
  std::string why_not;
  std::optional<PackageCache::Hit> forward = cache_.find(forward_key, &why_not);
  std::optional<PackageCache::Hit> backward;
  if (forward) backward = cache_.find(backward_key, &why_not);
  entry.cache_hit = forward && backward;
  // Built now, or side by side before the first step (prebuild()): either way not a cache hit.
  const auto prior = prebuilt_.find(sig.dump());
  const bool side_by_side = prior != prebuilt_.end() && prior->second.ran;
  std::optional<PairBuild> ran;
  if (side_by_side) {
    ran = prior->second;
  } else if (!entry.cache_hit) {
    ran = build(p, sig, forward_key, backward_key, why_not, at::get_num_threads(),
                /*isa_probe=*/true);
  }
  if (ran) {
    entry.cache_hit = false;
    entry.cache_note = side_by_side ? "built side by side before the first step" : why_not;
    if (ran->breaks) {
      const std::vector<GraphBreak>& breaks = ran->graph_breaks;
      report_.breaks.insert(report_.breaks.end(), breaks.begin(), breaks.end());
      if (options_.fullgraph) {
        throw TrainingError(fmt::format(
            "compile.fullgraph = true and {} has {} graph break(s): {}; remove them from "
            "the model, or set compile.fullgraph = false to run it eager",
            what(p), breaks.size(), describe_breaks(breaks)));
      }
      log::warn(
          fmt::format("compile: {} has {} graph break(s), so it runs eager "
                      "(compile.fullgraph = false): {}",
                      what(p), breaks.size(), describe_breaks(breaks)));
      auto pair = std::make_unique<UnitPair>();
      pair->eager = true;
      entry.eager = true;
      return pair;
    }
    forward = cache_.find(forward_key, &why_not);
    if (forward) backward = cache_.find(backward_key, &why_not);
    if (!forward || !backward) {
      throw UserError(fmt::format("{}'s packages, just built, are not in {}: {}", what(p),
                                  cache_.dir().string(), why_not));
    }
    entry.build_seconds = ran->seconds;
  }
  const auto load_begin = SteadyClock::now();
  const json& report = forward->record["report"];
  auto pair = std::make_unique<UnitPair>();
  const auto device_index = device_.is_cuda() ? device_.index() : static_cast<c10::DeviceIndex>(-1);
  pair->forward = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
      forward->package.string(), "model", false, 1, device_index);
  pair->backward = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
      backward->package.string(), "model", false, 1, device_index);
  // The pair's calling convention from its build record, checked against this piece.
  const size_t arguments = leading + piece.parameters.size();
  try {
    if (report.at("inputs").size() != arguments) throw std::out_of_range("inputs");
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
      "compile: {} for input {}: {} (load {:.2f} s)", what(p), entry.input,
      entry.cache_hit ? "cached packages" : fmt::format("built in {:.1f} s", entry.build_seconds),
      entry.load_seconds));
  return pair;
}

}  // namespace compiled_units_impl

std::shared_ptr<CompiledUnitWrapper> make_compiled_units(
    const CompileOptions& options, TrainOptions::Precision precision, bool compile_root,
    Model& model, torch::Device device, const PackageCache& cache, const json& model_json,
    CompileReport& report) {
  return std::make_shared<compiled_units_impl::CompiledUnits>(
      options, precision, compile_root, model, device, cache, model_json, report);
}

}  // namespace kiln
