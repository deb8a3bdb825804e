// Strict resume: the training state a checkpoint holds against the one the trainer (or a config)
// has, and the checkpoint settings a resumed run keeps (kiln/checkpoint.h resume_config).
#include "ckpt/resume.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "ckpt/internal.h"
#include "core/counters.h"
#include "core/strings.h"
#include "kiln/log.h"
#include "kiln/models.h"
#include "kiln/run.h"
#include "kiln/safetensors.h"

namespace kiln {
namespace ckpt {

using nlohmann::json;

StateShapes live_state_shapes(const TrainState& state, Communicator& comm) {
  StateShapes live;
  auto add = [&](const std::string& prefix, const NamedTensors& tensors) {
    for (const auto& [name, tensor] : tensors) {
      auto piece = state.pieces.find(name);
      live[prefix + name] = {
          piece != state.pieces.end()
              ? piece->second.global_shape
              : std::vector<int64_t>(tensor.sizes().begin(), tensor.sizes().end()),
          tensor.scalar_type()};
    }
  };
  add("model/", state.model);
  add("optim/", state.optimizer);
  if (comm.world_size() == 1) return live;
  json mine = json::object();
  for (const auto& [name, t] : live) {
    json entry = json::array();
    entry.push_back(json(t.shape));  // [] for a 0-dim tensor
    entry.push_back(static_cast<int>(t.dtype));
    mine[name] = std::move(entry);
  }
  for (const auto& text : comm.all_gather_bytes(mine.dump())) {
    const json theirs = json::parse(text);  // named: a range-for over a temporary's items() dangles
    for (const auto& [name, t] : theirs.items()) {
      live.emplace(name, TensorShape{t.at(0).is_array() ? t.at(0).get<std::vector<int64_t>>()
                                                        : std::vector<int64_t>{},
                                     static_cast<torch::ScalarType>(t[1].get<int>())});
    }
  }
  return live;
}

StateShapes model_state_shapes(Model& model, const OptimOptions& optim) {
  StateShapes out;
  NamedTensors parameters;
  for (const auto& item : model.named_parameters()) {
    const torch::Tensor& p = item.value();
    out["model/" + item.key()] = {p.sizes().vec(), p.scalar_type()};
    parameters.emplace_back(item.key(), torch::empty(p.sizes(), p.options().device(torch::kMeta)));
  }
  for (const auto& item : model.named_buffers())
    out["model/" + item.key()] = {item.value().sizes().vec(), item.value().scalar_type()};
  Optimizer optimizer(optim, parameters);
  for (const auto& [name, t] : optimizer.state())
    out["optim/" + name] = {t.sizes().vec(), t.scalar_type()};
  for (const auto& [name, t] : optimizer.step_counts())
    out["optim/" + name] = {t.sizes().vec(), t.scalar_type()};
  return out;
}

std::string state_difference(const CheckpointIndex& index, const StateShapes& live) {
  auto in_state = [](const std::string& name) {
    return name.starts_with("model/") || name.starts_with("optim/");
  };
  auto is_step_count = [](const std::string& name) {
    return name.starts_with("optim/") && name.ends_with(".step");
  };
  const bool saved_step_counts =
      std::any_of(index.tensors.begin(), index.tensors.end(),
                  [&](const TensorInfo& t) { return is_step_count(t.name); });
  std::map<std::string, std::string> differences;  // by tensor name: the first one is reported
  for (const auto& info : index.tensors) {
    if (!in_state(info.name)) continue;
    auto it = live.find(info.name);
    if (it == live.end()) {
      differences[info.name] =
          fmt::format("'{}' {} is in the checkpoint but not in the training state here", info.name,
                      shape_text(info.shape));
    } else if (it->second.shape != info.shape) {
      differences[info.name] =
          fmt::format("'{}' has shape {} in the checkpoint but {} here", info.name,
                      shape_text(info.shape), shape_text(it->second.shape));
    } else if (it->second.dtype != info.dtype) {
      differences[info.name] =
          fmt::format("'{}' is {} in the checkpoint but {} here", info.name,
                      safetensors_dtype(info.dtype), safetensors_dtype(it->second.dtype));
    }
  }
  for (const auto& [name, t] : live) {
    if (index.find(name) != nullptr || (!saved_step_counts && is_step_count(name))) continue;
    differences[name] =
        fmt::format("'{}' {} is in the training state here but not in the checkpoint", name,
                    shape_text(t.shape));
  }
  if (differences.empty()) return "";
  return fmt::format("{} difference{}; the first: {}", differences.size(),
                     differences.size() == 1 ? "" : "s", differences.begin()->second);
}

std::string state_mismatch_advice() {
  return "--resume restores a run exactly: resume with the config it was saved with (the run "
         "directory's config.toml), or start a new run.name from its weights with model.init_from "
         "(after `kiln export`)";
}

}  // namespace ckpt

ResumePlan locate_resume(const std::string& resume, const std::filesystem::path& checkpoint_dir) {
  ResumePlan plan;
  plan.argument = resume;
  if (resume.empty()) return plan;
  std::error_code ec;
  plan.search = resume == "auto" ? checkpoint_dir : std::filesystem::path(resume);
  plan.exact = std::filesystem::is_regular_file(plan.search / ckpt::kIndexFile, ec);
  if (plan.exact) {
    counters::count(counters::Event::kResumeIndexRead);
    plan.index = read_checkpoint_index(plan.search);  // a damaged index: the error to stop with
    plan.step_dir = plan.search;
    plan.any_committed = true;
    return plan;
  }
  if (resume != "auto" && !std::filesystem::is_directory(plan.search, ec)) {
    throw UserError("--resume " + resume +
                    ": no such checkpoint (give a step-<N> directory, a checkpoint directory, or "
                    "auto)");
  }
  const auto entries = list_checkpoints(plan.search);
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (!it->committed) continue;
    plan.any_committed = true;
    try {
      counters::count(counters::Event::kResumeIndexRead);
      plan.index = read_checkpoint_index(it->path);
      plan.step_dir = it->path;
      break;
    } catch (const UserError& e) {  // a damaged index: the load falls back past it too
      log::warn("checkpoint: cannot load " + it->path.string() + ": " + e.what() +
                "; falling back to the previous checkpoint");
    }
  }
  if (resume != "auto" && !plan.any_committed) {
    throw UserError("--resume " + resume +
                    ": holds no committed checkpoint (no index.json, no step-<N>/)");
  }
  return plan;
}

namespace ckpt {}  // namespace ckpt

namespace {

// The checkpoint settings a resumed run keeps from the run it continues, and their types.
constexpr std::pair<const char*, ValueType> kKeptSettings[] = {
    {"every_steps", ValueType::kInt}, {"keep_last_k", ValueType::kInt},
    {"keep_every", ValueType::kInt},  {"save_final", ValueType::kBool},
    {"async", ValueType::kBool},      {"on_save_error", ValueType::kString}};

}  // namespace

nlohmann::json ckpt::checkpoint_settings(const Config& config) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [key, type] : kKeptSettings) {
    const std::string full = std::string("checkpoint.") + key;
    switch (type) {
      case ValueType::kInt:
        out[key] = config.get_int(full);
        break;
      case ValueType::kBool:
        out[key] = config.get_bool(full);
        break;
      default:
        out[key] = config.get_string(full);
        break;
    }
  }
  return out;
}

Config resume_config(const Config& config, const ResumePlan& plan,
                     const std::vector<std::string>& explicit_keys) {
  if (!plan.index) return config;  // a fresh start, or no index reads (the load says why)
  const std::optional<std::filesystem::path>& step_dir = plan.step_dir;
  const nlohmann::json saved = plan.index->training_state.value("checkpointing", nlohmann::json());
  if (!saved.is_object()) return config;  // saved before kiln recorded its settings
  Config out = config;
  std::vector<std::string> kept;
  for (const auto& [key, type] : kKeptSettings) {
    const std::string full = std::string("checkpoint.") + key;
    if (!saved.contains(key) ||
        std::find(explicit_keys.begin(), explicit_keys.end(), full) != explicit_keys.end())
      continue;
    const nlohmann::json& value = saved[key];
    try {
      switch (type) {
        case ValueType::kInt:
          out.set(full, value.get<int64_t>());
          break;
        case ValueType::kBool:
          out.set(full, value.get<bool>());
          break;
        default:
          out.set(full, value.get<std::string>());
          break;
      }
    } catch (const nlohmann::json::exception&) {
      throw UserError(step_dir->string() + "/index.json: training_state.checkpointing." + key +
                      " is not a " + type_name(type));
    }
    if (out.get(full) != config.get(full))
      kept.push_back(full + " = " + value_to_toml(out.get(full)));
  }
  out.validate();
  if (!kept.empty()) {
    log::info(
        fmt::format("--resume: keeps the saved run's {} (--set overrides)", fmt::join(kept, ", ")));
  }
  return out;
}

}  // namespace kiln
