// The compiled step: builds (through python/kiln_py/compile.py) or finds in the cache one
// AOTInductor package per graph shape, binds the model's parameters to its constants, and runs
// forward+backward through it in the Trainer's step loop.
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <map>

#include "compile/compiled_units.h"
#include "compile/compiler_run.h"
#include "compile/internal.h"
#include "core/clock.h"
#include "core/files.h"
#include "core/process.h"
#include "core/strings.h"
#include "kiln/build_info.h"
#include "kiln/compile.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/models.h"
#include "train/executors.h"
#include "train/precision.h"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

struct CompiledStep::Loaded {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  std::vector<size_t> gradient_of;  // train: output k + 1 is the gradient of
                                    // parameters_[gradient_of[k]]
  bool correct = false;             // eval: output 1 counts the correct predictions
};

struct CompiledStep::Build {
  GraphShape shape;                      // what it was built for
  std::optional<PackageCache::Hit> hit;  // nullopt: graph breaks, nothing built
  bool cache_hit = false;
  std::string cache_note;          // why the cache missed ("" on a hit)
  double build_seconds = 0;        // 0 on a hit
  std::vector<GraphBreak> breaks;  // the compiler's, when it found any
};

namespace {

int64_t max_seq_len(const Model& model) {
  const json d = model.describe();
  return d.contains("block_size") ? d["block_size"].get<int64_t>() : 0;
}

json model_json(const Model& model) {
  json out = model.describe();
  out["name"] = model.architecture();
  return out;
}

// The graph shape a package's result says it accepts ({"inputs": {"shape": [4, {"name": "seq",
// "min": 2, "max": 16}]}, "targets": ...}); `asked` supplies nothing but a fallback on bad JSON.
GraphShape accepted_shape(const json& accepts, const GraphShape& asked) {
  GraphShape out{asked.shapes, {}};
  try {
    for (const char* tensor : {"inputs", "targets"}) {
      const json& dims = accepts.at(tensor).at("shape");
      auto& shape = std::string(tensor) == "inputs" ? out.shapes.inputs : out.shapes.targets;
      if (dims.size() != shape.size()) return asked;
      for (size_t d = 0; d < dims.size(); ++d) {
        if (dims[d].is_number_integer()) {
          shape[d] = dims[d].get<int64_t>();
        } else {
          out.dynamic.push_back({tensor, static_cast<int>(d), dims[d].at("name").get<std::string>(),
                                 dims[d].at("min").get<int64_t>(),
                                 dims[d].at("max").get<int64_t>()});
        }
      }
    }
  } catch (const json::exception&) {
    return asked;
  }
  return out;
}

std::string dtype_name(const torch::Tensor& t) {
  return t.scalar_type() == torch::kLong ? "int64" : "float32";
}

const char* kind_name(bool eval) {
  return eval ? "eval" : "train";
}

// What a graph's package depends on: `graph` is "train" or "eval".
Fingerprint fingerprint_of(const CompilerPython& python, const json& model, const char* graph,
                           const GraphShape& shape, torch::Device device,
                           TrainOptions::Precision precision, const Batch* example) {
  json fields = {
      {"kiln", build_info().version},
      {"torch", python.torch_version},
      {"torch_git", python.torch_git},
      {"compiler_script", python.script_hash},
      {"device", device.is_cuda() ? "cuda" : "cpu"},
      {"arch", cpu_model()},
      {"model", model},
      {"graph", graph},
      {"param_dtype", "float32"},
      // The autocast policy exported into the graph (and, for fp16-mixed, the loss-scale input).
      {"precision", precision_name(precision)},
      {"deterministic", at::globalContext().deterministicAlgorithms()},
      // Symbolic: a dynamic dimension's example size does not change the package's meaning.
      {"shape", shape.str()},
  };
  if (example) {
    fields["input_dtypes"] = {dtype_name(example->inputs), dtype_name(example->targets)};
  }
  return {fields};
}

}  // namespace

json CompileReport::to_json() const {
  auto graph_list = [](const std::vector<Graph>& list, const char* kind) {
    json out = json::array();
    for (const Graph& g : list) {
      out.push_back({{"graph", kind},
                     {"shape", g.shape.str()},
                     {"spec", g.shape.to_json()},
                     {"cache_hit", g.cache_hit},
                     {"cache_note", g.cache_note},
                     {"build_seconds", g.build_seconds},
                     {"load_seconds", g.load_seconds},
                     {"package", g.package}});
    }
    return out;
  };
  auto recompile_list = [](const std::vector<Recompile>& list, const char* kind) {
    json out = json::array();
    for (const Recompile& r : list) {
      out.push_back({{"graph", kind},
                     {"shapes", r.shapes.str()},
                     {"reason", r.reason},
                     {"compiled", r.compiled}});
    }
    return out;
  };
  json break_list = json::array();
  for (const GraphBreak& b : breaks)
    break_list.push_back({{"reason", b.reason}, {"where", b.where}});
  json unit_list = json::array(), root_list = json::array();
  for (const UnitGraph& g : unit_graphs) {
    const bool root = g.unit.starts_with("root.");  // the root's pieces (compile.root)
    (root ? root_list : unit_list)
        .push_back(
            {{root ? "piece" : "unit", g.unit},
             {"input", g.input},
             {"cache_hit", g.cache_hit},
             {"shared", g.shared},
             {"cache_note", g.cache_note},
             {"build_seconds", g.build_seconds},
             {"load_seconds", g.load_seconds},
             {"eager", g.eager},
             {"graphs", json::array({json{{"graph", root ? "root_forward" : "unit_forward"},
                                          {"package", g.forward_package}},
                                     json{{"graph", root ? "root_backward" : "unit_backward"},
                                          {"package", g.backward_package}}})}});
  }
  return {{"backend", backend},
          {"granularity", granularity},
          {"units", unit_list},
          {"root", root_list},
          {"unit_recompiles", unit_recompiles},
          {"eager_unit_calls", eager_unit_calls},
          {"compiled_unit_forwards", compiled_unit_forwards},
          {"dynamic", dynamic},
          {"precision", precision},
          {"fallback_to_eager", fallback_to_eager},
          {"graph_breaks", break_list},
          {"graphs", graph_list(graphs, "train")},
          {"recompiles", recompile_list(recompiles, "train")},
          {"eager_micro_steps", eager_micro_steps},
          {"eval",
           {{"graphs", graph_list(eval_graphs, "eval")},
            {"recompiles", recompile_list(eval_recompiles, "eval")},
            {"eager_batches", eval_eager_batches}}}};
}

CompiledStep::CompiledStep(const CompileOptions& options, TrainOptions::Precision precision,
                           Model& model, torch::Device device)
    : options_(options),
      precision_(precision),
      model_(model),
      device_(device),
      model_json_(model_json(model)),
      cache_(std::make_unique<PackageCache>(options_.cache_dir)),
      train_{false,
             std::make_unique<ShapeTracker>(options_.dynamic, options_.recompile_limit,
                                            max_seq_len(model)),
             {},
             nullptr},
      eval_{true,
            std::make_unique<ShapeTracker>(options_.dynamic, options_.recompile_limit,
                                           max_seq_len(model)),
            {},
            nullptr} {
  if (!options_.inductor()) {
    throw UserError(
        fmt::format("compile.backend = \"{}\" has no AOTInductor step; kiln builds one "
                    "for \"inductor\" and \"inductor+cudagraphs\"",
                    backend_name(options_.backend)));
  }
  for (auto& item : model.named_parameters()) parameters_.emplace_back(item.key(), item.value());
  for (auto& item : model.named_buffers()) buffers_.emplace_back(item.key(), item.value());
  CompilerPython::probe(options_.python);  // fails early, naming compile.python
  report_.granularity = granularity_name(options_.granularity);
  if (options_.granularity == CompileOptions::Granularity::kUnit) {
    if (model.units().empty()) {
      throw UserError(
          fmt::format("compile.granularity = \"unit\": model {} has no units to compile; set "
                      "compile.granularity = \"step\"",
                      model.architecture()));
    }
    // Innermost: activation checkpointing and FSDP (added before) wrap the compiled units.
    units_ = make_compiled_units(options_, precision_, options_.root, model, device, *cache_,
                                 model_json_, report_);
    model.add_unit_wrapper(units_);
  }
  report_.backend = backend_name(options_.backend);
  report_.dynamic = dynamic_name(options_.dynamic);
  report_.precision = precision_name(precision_);
}

CompiledStep::~CompiledStep() = default;

void CompiledStep::prepare(const InputShapes& train, const std::optional<InputShapes>& eval) {
  if (units_) return;  // per unit: each unit builds on its first call
  using Decision = ShapeTracker::Decision::Kind;
  if (eval && !report_.fallback_to_eager && options_.jobs >= 2) {
    const ShapeTracker::Decision train_decision = train_.tracker->decide(train);
    const ShapeTracker::Decision eval_decision = eval_.tracker->decide(*eval);
    if (train_decision.kind == Decision::kCompile && eval_decision.kind == Decision::kCompile) {
      // Each compiler process spends most of a cold build in one serial C++ compile: two at once
      // use two cores. What each build left is loaded below as a serial build would load it.
      const int threads = at::get_num_threads();  // per thread under OpenMP: read it here
      std::future<Build> eval_build = std::async(std::launch::async, [&] {
        return build_package(/*eval=*/true, eval_decision.shape, threads);
      });
      Build train_build = build_package(/*eval=*/false, train_decision.shape, threads);
      eval_.built = std::make_unique<Build>(eval_build.get());
      train_.built = std::make_unique<Build>(std::move(train_build));
    }
  }
  resolve(train_, train);
  if (eval) resolve(eval_, *eval);
  eval_.built.reset();  // unused when the train graph's breaks made the step eager
}

// The graph of `kind` that runs `shapes` (building or loading it on first sight), or SIZE_MAX
// when they run eager: graph breaks under fullgraph = false, or a shape over the recompile limit.
size_t CompiledStep::resolve(Kind& kind, const InputShapes& shapes) {
  using Decision = ShapeTracker::Decision::Kind;
  if (report_.fallback_to_eager) return SIZE_MAX;
  std::vector<Recompile>& recompiles = kind.eval ? report_.eval_recompiles : report_.recompiles;
  const std::string prefix = kind.eval ? "compile: eval graph: " : "compile: ";
  ShapeTracker::Decision decision = kind.tracker->decide(shapes);
  if (decision.kind == Decision::kReuse) return decision.graph;
  if (decision.kind == Decision::kEager) {
    const auto& eager = kind.tracker->eager_shapes();
    if (std::find(eager.begin(), eager.end(), shapes) == eager.end()) {
      log::warn(prefix + decision.reason);
      kind.tracker->record(shapes, decision);
      recompiles = kind.tracker->recompiles();
    }
    return SIZE_MAX;
  }
  const size_t graph = load_graph(kind, decision.shape);
  if (graph == SIZE_MAX) return SIZE_MAX;  // breaks, fullgraph = false: eager from now on
  kind.tracker->record(shapes, decision);
  recompiles = kind.tracker->recompiles();
  if (!decision.reason.empty()) log::info(prefix + "recompile: " + decision.reason);
  return graph;
}

StepExecutor::EvalOutputs CompiledStep::evaluate(const Batch& batch) {
  if (units_) {
    // Per unit with a compiled root: the root's forward packages around the compiled units (no
    // gradient: nothing saved), under the precision's autocast as the eager executor evaluates.
    // Without one (or for a classifier, which counts correct predictions from the logits):
    // declined, so the eager root runs around the compiled units.
    auto& units = static_cast<CompiledUnitWrapper&>(*units_);
    if (!units.compiles_root() || model_.classifier()) return {};
    const auto autocast = precision_autocast(precision_, device_.type());
    EvalOutputs out;
    out.loss = units.root_loss(batch.inputs, batch.targets);
    return out;
  }
  const size_t index = resolve(eval_, InputShapes::of(batch));
  if (index == SIZE_MAX) {
    if (!report_.fallback_to_eager) ++report_.eval_eager_batches;  // over the recompile limit
    return {};
  }
  const Loaded& graph = *eval_.loaded[index];
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> outputs =
      graph.loader->run({batch.inputs.contiguous(), batch.targets.contiguous()});
  EvalOutputs out;
  out.loss = outputs[0];
  if (graph.correct) out.correct = outputs[1];
  return out;
}

torch::Tensor CompiledStep::forward_backward(Trainer& trainer, const Batch& batch, double scale,
                                             const torch::Tensor& loss_scale) {
  if (units_) {
    // Per unit with a compiled root: the eager executor's micro-step with the model's forward
    // split into the root's compiled pieces around its wrapped units. Without one: declined, so
    // the Trainer's eager step runs the compiled units inside the model's forward.
    auto& units = static_cast<CompiledUnitWrapper&>(*units_);
    if (!units.compiles_root()) return {};
    return autograd_micro_step(trainer, precision_, device_.type(), scale, loss_scale,
                               [&] { return units.root_loss(batch.inputs, batch.targets); });
  }
  PhaseScope phase(trainer, Phase::kForward);  // forward and backward in one compiled call
  const bool scaled = precision_ == TrainOptions::Precision::kFp16Mixed;
  if (loss_scale.defined() != scaled) {
    throw UserError(fmt::format(
        "the compiled step was built for train.precision = \"{}\" and called {} a loss scale; "
        "build the Trainer and the compiled step from the same config",
        precision_name(precision_), loss_scale.defined() ? "with" : "without"));
  }
  const size_t index = resolve(train_, InputShapes::of(batch));
  if (index == SIZE_MAX) {
    if (!report_.fallback_to_eager) ++report_.eager_micro_steps;  // over the recompile limit
    return {};
  }
  Loaded& graph = *train_.loaded[index];
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> inputs = {batch.inputs.contiguous(), batch.targets.contiguous()};
  if (scaled) inputs.push_back(loss_scale.reshape({1}).to(torch::kFloat).contiguous());
  std::vector<torch::Tensor> outputs = graph.loader->run(inputs);
  // fp16-mixed: the graph's loss output is loss x scale (the value it differentiates); the scale
  // is a power of two, so dividing it out is exact.
  if (scaled) outputs[0] = outputs[0] / loss_scale.reshape({});
  for (size_t k = 0; k < graph.gradient_of.size(); ++k) {
    torch::Tensor& param = parameters_[graph.gradient_of[k]].second;
    torch::Tensor& gradient = outputs[k + 1];
    if (!param.grad().defined()) {
      param.mutable_grad() = scale == 1.0 ? gradient : gradient.mul(scale);
    } else {
      param.mutable_grad().add_(gradient, scale);
    }
  }
  return scale == 1.0 ? outputs[0] : outputs[0].mul(scale);
}

CompiledStep::Build CompiledStep::build_package(bool eval, const GraphShape& shape,
                                                int threads) const {
  const CompilerPython& python = CompilerPython::probe(options_.python);
  const char* graph_kind = kind_name(eval);
  const Fingerprint fingerprint =
      fingerprint_of(python, model_json_, graph_kind, shape, device_, precision_, nullptr);
  Build out;
  out.shape = shape;
  // One builder per package across processes: the others wait here, then find it built.
  PackageCache::BuildLock lock(*cache_, fingerprint);
  std::string why_not;
  out.hit = cache_->find(fingerprint, &why_not);
  out.cache_hit = out.hit.has_value();
  if (out.hit) return out;
  out.cache_note = why_not;
  log::info(fmt::format("compile: building the {} graph for {} with AOTInductor ({}; cache {}: {})",
                        eval ? "eval (forward and loss)" : "forward+backward", shape.str(),
                        python.torch_version, cache_->dir().string(), why_not));
  const auto begin = SteadyClock::now();
  const fs::path scratch = cache_->scratch_dir(fingerprint);
  const ModelSpec* model_spec = find_model(model_json_.value("name", ""));
  const bool tokens = model_spec && model_spec->input == ModelInput::kTokens;
  const json spec = {
      {"model", model_json_},
      {"graph", graph_kind},
      {"inputs", {{"shape", shape.shapes.inputs}, {"dtype", tokens ? "int64" : "float32"}}},
      {"targets", {{"shape", shape.shapes.targets}, {"dtype", "int64"}}},
      {"dynamic", shape.to_json()["dynamic"]},
      {"package", (scratch / "model.pt2").string()},
      {"threads", threads},
  };
  const CompilerRun run = run_compiler(python, scratch, spec, device_, precision_, "the step");
  if (run.graph_breaks()) {
    out.breaks = run.breaks();
    return out;
  }
  run.check_built("the step");
  out.hit = cache_->publish(fingerprint, scratch / "model.pt2", run.result);
  std::error_code ec;
  fs::remove_all(scratch, ec);
  out.build_seconds = seconds_since(begin);
  return out;
}

size_t CompiledStep::load_graph(Kind& kind, GraphShape& shape) {
  const char* graph_kind = kind_name(kind.eval);
  std::unique_ptr<Build> prepared = std::move(kind.built);
  Build built = prepared && prepared->shape.str() == shape.str()
                    ? std::move(*prepared)
                    : build_package(kind.eval, shape, at::get_num_threads());
  CompileReport::Graph entry;
  entry.shape = shape;
  entry.cache_hit = built.cache_hit;
  entry.cache_note = built.cache_note;
  entry.build_seconds = built.build_seconds;
  if (!built.hit) {  // graph breaks
    report_.breaks.insert(report_.breaks.end(), built.breaks.begin(), built.breaks.end());
    const std::string list = describe_breaks(report_.breaks);
    if (options_.fullgraph) {
      throw TrainingError(fmt::format(
          "compile.fullgraph = true and the step has {} graph break(s): {}; remove them from the "
          "model, or set compile.fullgraph = false to run the step eager",
          report_.breaks.size(), list));
    }
    log::warn(
        fmt::format("compile: {} graph break(s), so the step runs eager "
                    "(compile.fullgraph = false): {}",
                    report_.breaks.size(), list));
    report_.fallback_to_eager = true;
    return SIZE_MAX;
  }
  const std::optional<PackageCache::Hit>& hit = built.hit;
  const auto load_begin = SteadyClock::now();
  auto loaded = std::make_unique<Loaded>();
  loaded->loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
      hit->package.string(), "model", /*run_single_threaded=*/false, /*num_runners=*/1,
      device_.is_cuda() ? device_.index() : static_cast<c10::DeviceIndex>(-1));
  std::map<std::string, size_t> index;
  for (size_t k = 0; k < parameters_.size(); ++k) index[parameters_[k].first] = k;
  std::unordered_map<std::string, torch::Tensor> constants;
  std::map<std::string, size_t> buffer_index;
  for (size_t k = 0; k < buffers_.size(); ++k) buffer_index[buffers_[k].first] = k;
  for (const std::string& name : loaded->loader->get_constant_fqns()) {
    if (auto it = index.find(name); it != index.end()) {
      constants[name] = parameters_[it->second].second;
    } else if (auto b = buffer_index.find(name); b != buffer_index.end()) {
      constants[name] = buffers_[b->second].second;
    } else {
      throw UserError(
          fmt::format("the compiled package {} has constant {}, which is not a "
                      "parameter or buffer of the model; remove it from compile.cache_dir",
                      hit->package.string(), name));
    }
  }
  // The model's own tensors, not copies: the optimizer's in-place updates are what runs next.
  loaded->loader->load_constants(constants, /*use_inactive=*/false, /*check_full_update=*/true,
                                 /*user_managed=*/true);
  const json& report = hit->record["report"];
  // The shapes the package really accepts (export may specialise a dimension asked dynamic):
  // the tracker guards with these, since a package called with another shape is not checked.
  if (report.contains("accepts")) {
    GraphShape accepted = accepted_shape(report["accepts"], shape);
    auto sorted = [](std::vector<DynamicDim> dims) {
      std::sort(dims.begin(), dims.end(), [](const DynamicDim& a, const DynamicDim& b) {
        return std::tie(a.tensor, a.dim) < std::tie(b.tensor, b.dim);
      });
      return dims;
    };
    if (sorted(accepted.dynamic) != sorted(shape.dynamic) || accepted.shapes != shape.shapes) {
      log::warn(fmt::format("compile: asked for {}, the package accepts {}", shape.str(),
                            accepted.str()));
      shape = accepted;
      entry.shape = accepted;
    }
  }
  const json expected_inputs = !kind.eval && precision_ == TrainOptions::Precision::kFp16Mixed
                                   ? json{"inputs", "targets", "loss_scale"}
                                   : json{"inputs", "targets"};
  if (report.value("inputs", json{"inputs", "targets"}) != expected_inputs) {
    throw UserError(fmt::format(
        "the compiled package {} takes {}, not {} (train.precision = \"{}\"); remove it from "
        "compile.cache_dir",
        hit->package.string(), report.value("inputs", json::array()).dump(), expected_inputs.dump(),
        precision_name(precision_)));
  }
  if (kind.eval) {
    const json outputs = report.value("outputs", json::array());
    if (outputs.empty() || outputs[0] != "loss" || outputs.size() > 2 ||
        (outputs.size() == 2 && outputs[1] != "correct")) {
      throw UserError(fmt::format(
          "the compiled eval package {} returns {}, not the loss (and correct predictions); "
          "remove it from compile.cache_dir",
          hit->package.string(), outputs.dump()));
    }
    loaded->correct = outputs.size() == 2;
  }
  for (const auto& name : report.value("parameters", json::array())) {
    auto it = index.find(name.get<std::string>());
    if (it == index.end()) {
      throw UserError(
          fmt::format("the compiled package {} returns a gradient for {}, which is "
                      "not a parameter of the model; remove it from compile.cache_dir",
                      hit->package.string(), name.get<std::string>()));
    }
    loaded->gradient_of.push_back(it->second);
  }
  if (!kind.eval && loaded->gradient_of.size() != parameters_.size()) {
    throw UserError(
        fmt::format("the compiled package {} returns {} gradients for {} parameters; "
                    "remove it from compile.cache_dir",
                    hit->package.string(), loaded->gradient_of.size(), parameters_.size()));
  }
  entry.load_seconds = seconds_since(load_begin);
  entry.package = hit->package.string();
  log::info(fmt::format(
      "compile: {} graph {} for {}: {} (load {:.2f} s)", graph_kind, kind.loaded.size(),
      shape.str(),
      entry.cache_hit ? "cached package" : fmt::format("built in {:.1f} s", entry.build_seconds),
      entry.load_seconds));
  (kind.eval ? report_.eval_graphs : report_.graphs).push_back(std::move(entry));
  kind.loaded.push_back(std::move(loaded));
  return kind.loaded.size() - 1;
}

void check_compile_start(const Config& config) {
  const CompileOptions options = CompileOptions::from_config(config);
  if (options.backend == CompileOptions::Backend::kEager) return;
  // The combinations (precision, activation checkpointing, FSDP, device, fused optimizer) are
  // the [compile] section's rules, checked when the config was loaded. What remains depends on
  // this build and machine:
  if (options.cuda_graphs()) {
    cuda_graph_recorders(resolve_device(config));  // CUDA device and a CUDA build, else UserError
  }
  if (!options.inductor()) return;
  CompilerPython::probe(options.python);
  PackageCache cache(options.cache_dir);
}

std::shared_ptr<CompiledStep> attach_compiled_step(Trainer& trainer, const Config& config) {
  CompileOptions options = CompileOptions::from_config(config);
  if (trainer.options().world_size > 1) options.prebuild_pieces = false;
  std::shared_ptr<CompiledStep> step;
  if (options.inductor()) {
    trainer.enter_composition_stage(CompositionStage::kCompilation, "compiled step (inductor)");
    step = std::make_shared<CompiledStep>(options, TrainOptions::from_config(config).precision,
                                          trainer.model(), trainer.options().device);
    trainer.set_step_executor(step);
    if (trainer.options().world_size > 1 && !step->per_unit()) {
      log::info(
          "compile: under DDP the package returns the gradients, so their all-reduce starts only "
          "after it (no overlap with backward); `kiln compile` under torchrun measures the "
          "overlap lost");
    }
  }
  return step;
}

}  // namespace kiln
