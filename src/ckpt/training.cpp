// The checkpoint's view of a Trainer: capturing and restoring the full training state, the
// periodic checkpointer hook, and `kiln train --resume`.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <fmt/format.h>
#include <torch/cuda.h>

#include "ckpt/internal.h"
#include "core/files.h"
#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/session.h"

namespace kiln {
namespace {

using nlohmann::json;

std::string cpu_rng_name(int rank) {
  return "rng/rank-" + std::to_string(rank) + "/cpu";
}
std::string cuda_rng_name(int rank, int device) {
  return "rng/rank-" + std::to_string(rank) + "/cuda-" + std::to_string(device);
}

int cuda_device_count() {
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

at::Generator cuda_generator(int device) {
  return at::globalContext().defaultGenerator(
      at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
}

torch::Tensor generator_state(at::Generator generator) {
  std::lock_guard lock(generator.mutex());
  return generator.get_state();
}

void set_generator_state(at::Generator generator, const torch::Tensor& state) {
  std::lock_guard lock(generator.mutex());
  generator.set_state(state);
}

// A rank's own tensor (its RNG state): "sharded" with one piece, so each rank's copy is kept.
StateTensor own_tensor(std::string name, torch::Tensor tensor) {
  std::vector<int64_t> shape(tensor.sizes().begin(), tensor.sizes().end());
  std::vector<int64_t> zeros(shape.size(), 0);
  return StateTensor(std::move(name), std::move(tensor), shape, zeros);
}

// Model parameters and buffers, and optimizer state: the live tensors (load writes into them).
// For saving, buffers are copied now: a forward pass may update them (batch-norm statistics)
// before a background save has staged them; parameters and optimizer state change only in the
// optimizer step, which the CheckpointHook fences.
std::vector<StateTensor> model_and_optimizer(Trainer& trainer, bool copy_buffers) {
  torch::NoGradGuard no_grad;
  std::vector<StateTensor> tensors;
  for (const auto& item : trainer.model().named_parameters())
    tensors.push_back({"model/" + item.key(), item.value()});
  for (const auto& item : trainer.model().named_buffers()) {
    tensors.push_back({"model/" + item.key(), copy_buffers ? item.value().clone() : item.value()});
  }
  for (const auto& [name, tensor] : trainer.optimizer().state())
    tensors.push_back({"optim/" + name, tensor});
  return tensors;
}

json lr_schedule_state(const Config& config, int64_t step) {
  return {{"kind", "function of the step (kiln::learning_rate)"},
          {"schedule", config.get_string("optim.schedule")},
          {"peak_lr", config.get_float("optim.lr")},
          {"warmup_steps", config.get_int("optim.warmup_steps")},
          {"min_lr_ratio", config.get_float("optim.min_lr_ratio")},
          {"total_steps", config.get_int("train.steps")},
          {"next_lr", learning_rate(config, step)}};
}

// The loader position for this rank: the saved one at the same world size and batch size, else the
// saved global position converted (samples consumed in the epoch are kept).
LoaderPosition resume_position(Trainer& trainer, const CheckpointIndex& index, int rank) {
  const int world = trainer.options().world_size;
  const int64_t batch_size = trainer.loader().options().batch_size;
  const json& saved = index.ranks.at(static_cast<size_t>(index.world_size == world ? rank : 0));
  if (!saved.contains("loader"))
    throw UserError("checkpoint has no loader position (not a training checkpoint)");
  const json& loader = saved["loader"];
  LoaderPosition position{loader.at("epoch").get<int64_t>(), loader.at("batch").get<int64_t>()};
  const int64_t saved_batch_size = loader.value("batch_size", batch_size);
  const int64_t saved_world = loader.value("world_size", static_cast<int64_t>(index.world_size));
  if (saved_world == world && saved_batch_size == batch_size) return position;
  const int64_t consumed = position.batch * saved_batch_size * saved_world;
  const int64_t global_batch = batch_size * world;
  if (consumed % global_batch != 0) {
    log::warn(fmt::format(
        "checkpoint: {} samples of epoch {} were consumed at world size {} x batch {}; at world "
        "size {} x batch {} the epoch resumes at the nearest earlier batch",
        consumed, position.epoch, saved_world, saved_batch_size, world, batch_size));
  }
  position.batch = consumed / global_batch;
  if (position.batch >= trainer.loader().sampler().batches_per_epoch()) {
    position = {position.epoch + 1, 0};
  }
  return position;
}

// Loads one checkpoint into the trainer. Throws UserError; the trainer is untouched then.
LoadResult restore_from(Trainer& trainer, Communicator& comm,
                        const std::filesystem::path& step_dir) {
  CheckpointIndex index;
  std::string error;
  try {
    index = read_checkpoint_index(step_dir);
  } catch (const UserError& e) {
    error = e.what();
  }
  ckpt::agree(comm, error);
  const int rank = comm.rank();
  std::vector<StateTensor> targets = model_and_optimizer(trainer, /*copy_buffers=*/false);
  // RNG states: this rank's, when the saving world had this rank and the generator matches.
  std::vector<std::pair<at::Generator, size_t>> generators;
  auto add_rng = [&](const std::string& name, at::Generator generator) {
    const TensorInfo* info = index.find(name);
    torch::Tensor current = generator_state(generator);
    if (!info ||
        info->shape != std::vector<int64_t>(current.sizes().begin(), current.sizes().end())) {
      log::warn("checkpoint: " + step_dir.string() + " has no " + name +
                "; that generator keeps its seeded state");
      return;
    }
    generators.emplace_back(generator, targets.size());
    targets.push_back(own_tensor(name, torch::empty_like(current)));
  };
  add_rng(cpu_rng_name(rank), at::detail::getDefaultCPUGenerator());
  for (int d = 0; d < cuda_device_count(); ++d) add_rng(cuda_rng_name(rank, d), cuda_generator(d));

  // Everything the training state needs is checked before any tensor is loaded.
  const json& state = index.training_state;
  int64_t step = 0, optimizer_steps = 0;
  LoaderPosition position;
  try {
    step = state.at("step").get<int64_t>();
    optimizer_steps = state.at("optimizer_steps").get<int64_t>();
    position = resume_position(trainer, index, rank);
    error.clear();
  } catch (const json::exception& e) {
    error = step_dir.string() + ": training_state is incomplete (" + std::string(e.what()) + ")";
  } catch (const UserError& e) {
    error = step_dir.string() + ": " + e.what();
  }
  ckpt::agree(comm, error);

  LoadResult result = load_checkpoint(step_dir, targets, comm);
  trainer.optimizer().load_state(trainer.optimizer().state(), optimizer_steps);
  trainer.set_step(step);
  trainer.set_skipped_steps(state.value("skipped_steps", int64_t{0}));
  trainer.loader().seek(position);
  for (const auto& [generator, k] : generators) set_generator_state(generator, targets[k].tensor);

  const Config& config = trainer.config();
  const std::string saved_hash = state.contains("config_hash") && state["config_hash"].is_string()
                                     ? state["config_hash"].get<std::string>()
                                     : "?";
  if (saved_hash != config.hash()) {
    log::warn("checkpoint: " + step_dir.string() + " was saved with another config (hash " +
              saved_hash + ", now " + config.hash() + ")");
  }
  const json* saved_lr = state.contains("lr_schedule") && state["lr_schedule"].is_object() &&
                                 state["lr_schedule"].contains("next_lr") &&
                                 state["lr_schedule"]["next_lr"].is_number()
                             ? &state["lr_schedule"]["next_lr"]
                             : nullptr;
  if (saved_lr && saved_lr->get<double>() != learning_rate(config, step)) {
    log::warn(fmt::format(
        "checkpoint: the learning-rate schedule changed: step {} had lr {} when saved, the config "
        "now gives {}",
        step + 1, saved_lr->get<double>(), learning_rate(config, step)));
  }
  log::info(fmt::format("resumed from {} at step {} (epoch {}, batch {})", step_dir.string(), step,
                        position.epoch, position.batch));
  return result;
}

}  // namespace

CheckpointOptions checkpoint_options(const Config& config, const std::filesystem::path& run_dir) {
  CheckpointOptions options;
  const std::string& dir = config.get_string("checkpoint.dir");
  options.dir = dir.empty() ? run_dir / "checkpoints" : std::filesystem::path(dir);
  options.keep_last_k = config.get_int("checkpoint.keep_last_k");
  options.keep_every = config.get_int("checkpoint.keep_every");
  options.async = config.get_bool("checkpoint.async");
  options.background_staging = options.async;  // CheckpointHook fences before the optimizer step
  return options;
}

SaveRequest capture_training_state(Trainer& trainer, Communicator& comm,
                                   const std::filesystem::path& manifest) {
  const Config& config = trainer.config();
  const int rank = comm.rank();
  SaveRequest request;
  request.step = trainer.step();
  request.tensors = model_and_optimizer(trainer, /*copy_buffers=*/true);
  request.tensors.push_back(
      own_tensor(cpu_rng_name(rank), generator_state(at::detail::getDefaultCPUGenerator())));
  json cuda = nullptr;
  if (const int devices = cuda_device_count(); devices > 0) {
    cuda = json::array();
    for (int d = 0; d < devices; ++d) {
      request.tensors.push_back(
          own_tensor(cuda_rng_name(rank, d), generator_state(cuda_generator(d))));
      cuda.push_back(cuda_rng_name(rank, d));
    }
  }
  const LoaderPosition position = trainer.loader().position();
  request.rank_state = {{"rank", rank},
                        {"loader",
                         {{"epoch", position.epoch},
                          {"batch", position.batch},
                          {"batch_size", trainer.loader().options().batch_size},
                          {"world_size", trainer.options().world_size},
                          {"batches_per_epoch", trainer.loader().sampler().batches_per_epoch()}}},
                        {"rng", {{"cpu", cpu_rng_name(rank)}, {"cuda", cuda}}}};
  json manifest_pointer = {{"path", manifest.string()}, {"xxh3", nullptr}};
  std::error_code ec;
  if (!manifest.empty() && std::filesystem::is_regular_file(manifest, ec)) {
    manifest_pointer["xxh3"] = hex64(hash_file(manifest));
  }
  request.training_state = {{"step", trainer.step()},
                            {"epoch", position.epoch},
                            {"optimizer_steps", trainer.optimizer().steps_taken()},
                            {"skipped_steps", trainer.skipped_steps()},
                            {"lr_schedule", lr_schedule_state(config, trainer.step())},
                            {"grad_scaler", nullptr},
                            {"config_hash", config.hash()},
                            {"run_manifest", std::move(manifest_pointer)},
                            {"model", trainer.model().architecture()},
                            {"optimizer", config.get_string("optim.name")}};
  return request;
}

std::optional<LoadResult> restore_training_state(Trainer& trainer, Communicator& comm,
                                                 const std::filesystem::path& path,
                                                 bool dir_fallback) {
  if (!dir_fallback) return restore_from(trainer, comm, path);
  json steps = json::array();
  if (comm.rank() == 0) {
    for (const auto& entry : list_checkpoints(path)) {
      if (entry.committed) steps.push_back(entry.step);
    }
  }
  steps = json::parse(comm.all_gather_bytes(steps.dump())[0]);
  if (steps.empty()) return std::nullopt;
  std::string newest_error;
  for (size_t k = steps.size(); k-- > 0;) {
    const std::filesystem::path step_dir = path / ckpt::step_dir_name(steps[k].get<int64_t>());
    try {
      return restore_from(trainer, comm, step_dir);
    } catch (const UserError& e) {
      if (newest_error.empty()) newest_error = e.what();
      log::warn("checkpoint: cannot resume from " + step_dir.string() + ": " + e.what() +
                (k > 0 ? "; falling back to the previous checkpoint" : ""));
    }
  }
  throw UserError("no loadable checkpoint in " + path.string() + " (" +
                  std::to_string(steps.size()) + " tried; the newest failed with: " + newest_error +
                  "); run `kiln ckpt list " + path.string() + "`");
}

// ---- CheckpointHook ----------------------------------------------------------------------------

CheckpointHook::CheckpointHook(const Config& config, CheckpointOptions options, Communicator& comm,
                               std::filesystem::path manifest)
    : every_steps_(config.get_int("checkpoint.every_steps")),
      save_final_(config.get_bool("checkpoint.save_final")),
      stop_on_error_(config.get_string("checkpoint.on_save_error") == "stop"),
      comm_(comm),
      manifest_(std::move(manifest)),
      checkpointer_(std::move(options), comm) {}

void CheckpointHook::check() {
  while (checked_ < saves_.size() && saves_[checked_]->finished()) {
    const auto& handle = saves_[checked_++];
    if (handle->committed()) continue;
    if (stop_on_error_) {
      throw TrainingError(
          handle->error() + "; the previous checkpoints are intact; free space in " +
          checkpointer_.options().dir.string() + " or set checkpoint.on_save_error = \"continue\"");
    }
    log::warn("checkpoint: training continues without the step " + std::to_string(handle->step()) +
              " checkpoint (checkpoint.on_save_error = \"continue\")");
  }
}

void CheckpointHook::save(Trainer& trainer) {
  checkpointer_
      .wait();  // at most one save in flight; its failure is acted on before the next starts
  check();
  saves_.push_back(checkpointer_.save(capture_training_state(trainer, comm_, manifest_)));
  last_saved_step_ = trainer.step();
}

void CheckpointHook::on_train_begin(Trainer& trainer) {
  // A resumed run starts at the step of the checkpoint it came from: no need to save that again.
  if (trainer.step() > 0 && last_saved_step_ < 0) last_saved_step_ = trainer.step();
}

void CheckpointHook::on_gradients_ready(Trainer& trainer) {
  if (!checkpointer_.in_flight()) return;
  trainer.phase_begin(Phase::kCheckpoint);
  checkpointer_.wait_for_staging();  // the optimizer step is about to change the saved tensors
  trainer.phase_end(Phase::kCheckpoint);
}

void CheckpointHook::on_step_end(Trainer& trainer, const StepStats&) {
  trainer.phase_begin(Phase::kCheckpoint);
  try {
    checkpointer_.poll();
    check();
    if (every_steps_ > 0 && trainer.step() % every_steps_ == 0) {
      save(trainer);
      check();
    }
  } catch (...) {
    trainer.phase_end(Phase::kCheckpoint);
    throw;
  }
  trainer.phase_end(Phase::kCheckpoint);
}

void CheckpointHook::on_train_end(Trainer& trainer) {
  trainer.phase_begin(Phase::kCheckpoint);
  try {
    if (save_final_ && every_steps_ > 0 && last_saved_step_ != trainer.step()) save(trainer);
    checkpointer_.wait();
    check();
  } catch (...) {
    trainer.phase_end(Phase::kCheckpoint);
    throw;
  }
  trainer.phase_end(Phase::kCheckpoint);
}

std::shared_ptr<CheckpointHook> attach_checkpointing(Session& session, const std::string& resume) {
  Trainer& trainer = *session.trainer;
  Communicator& comm = *session.comm;
  const CheckpointOptions options = checkpoint_options(session.config, session.run->dir());
  if (resume == "auto") {
    if (!restore_training_state(trainer, comm, options.dir, /*dir_fallback=*/true)) {
      log::info("--resume auto: no checkpoint in " + options.dir.string() +
                "; training starts at step 0");
    }
  } else if (!resume.empty()) {
    const std::filesystem::path path(resume);
    std::error_code ec;
    if (std::filesystem::is_regular_file(path / ckpt::kIndexFile, ec)) {
      restore_training_state(trainer, comm, path, /*dir_fallback=*/false);
    } else if (!std::filesystem::is_directory(path, ec)) {
      throw UserError("--resume " + resume +
                      ": no such checkpoint (give a step-<N> directory, a checkpoint "
                      "directory, or auto)");
    } else if (!restore_training_state(trainer, comm, path, /*dir_fallback=*/true)) {
      throw UserError("--resume " + resume +
                      ": holds no committed checkpoint (no index.json, no step-<N>/)");
    }
  }
  if (session.config.get_int("checkpoint.every_steps") <= 0) return nullptr;
  auto hook = std::make_shared<CheckpointHook>(session.config, options, comm,
                                               session.run->dir() / "manifest.json");
  trainer.add_hook(hook);
  return hook;
}

}  // namespace kiln
