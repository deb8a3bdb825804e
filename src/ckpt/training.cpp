// The checkpoint's view of a Trainer: capturing and restoring the full training state, the
// periodic checkpointer hook, and `kiln train --resume`.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "ckpt/internal.h"
#include "ckpt/resume.h"
#include "core/files.h"
#include "core/stop_signals.h"
#include "core/strings.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/run.h"

namespace kiln {
namespace {

using nlohmann::json;

std::string rng_name(int rank, const std::string& generator) {
  return "rng/rank-" + std::to_string(rank) + "/" + generator;
}

// A rank's own tensor (its RNG state): "sharded" with one piece, so each rank's copy is kept.
StateTensor own_tensor(std::string name, torch::Tensor tensor) {
  std::vector<int64_t> shape(tensor.sizes().begin(), tensor.sizes().end());
  std::vector<int64_t> zeros(shape.size(), 0);
  return StateTensor(std::move(name), std::move(tensor), shape, zeros);
}

// The loader position for this rank in the trainer's terms (`live`): the saved one at the same
// world size and batch size, else the saved global position converted (samples consumed in the
// epoch are kept).
LoaderPosition resume_position(const TrainState& live, const CheckpointIndex& index, int rank) {
  const int world = live.world_size;
  const int64_t batch_size = live.batch_size;
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
  if (position.batch >= live.batches_per_epoch) position = {position.epoch + 1, 0};
  return position;
}

// A model or optimizer tensor of the state, appended to `out`: whole, or this rank's piece (FSDP,
// tensor parallelism) at its offsets, or the piece's boxes as parts (TensorPiece::boxes).
void add_state_tensor(std::vector<StateTensor>& out, const std::string& prefix,
                      const std::string& name, const torch::Tensor& tensor,
                      const TrainState& state) {
  auto piece = state.pieces.find(name);
  if (piece == state.pieces.end()) {
    out.emplace_back(prefix + name, tensor);
    return;
  }
  const TensorPiece& p = piece->second;
  if (p.boxes.empty()) {
    out.emplace_back(prefix + name, tensor, p.global_shape, p.offsets);
    return;
  }
  for (size_t k = 0; k < p.boxes.size(); ++k) {
    const TensorPiece::Box& box = p.boxes[k];
    out.emplace_back(prefix + name, tensor.narrow(0, box.row, box.rows), p.global_shape,
                     box.offsets);
    out.back().part = static_cast<int>(k);
  }
}

bool is_step_count(const std::string& name) {
  return name.ends_with(".step");
}

// Loads one checkpoint into the trainer. Throws UserError on every rank when any rank fails (every
// local failure goes through ckpt::agree); the trainer is untouched then, unless restoring the
// loaded state itself failed.
LoadResult restore_from(Trainer& trainer, Communicator& comm, const std::filesystem::path& step_dir,
                        const std::string& config_hash,
                        const CheckpointIndex* read_index = nullptr) {
  CheckpointIndex index;
  std::string error;
  try {
    index = read_index ? *read_index : read_checkpoint_index(step_dir);
  } catch (const std::exception& e) {
    error = one_line_error(e);
  }
  ckpt::agree(comm, error);
  const int rank = comm.rank();

  // Everything the training state needs is checked before any tensor is loaded. The targets
  // alias the trainer's live tensors (the load writes into them); RNG states load into fresh
  // tensors that load_state then applies.
  const json& saved = index.training_state;
  TrainState state;
  std::vector<StateTensor> targets;
  std::vector<std::pair<size_t, size_t>> rng_targets;  // (state.rng index, targets index)
  bool saved_step_counts = true;                       // format 1 checkpoints have none
  try {
    state = trainer.state();
    for (const auto& [name, tensor] : state.model)
      add_state_tensor(targets, "model/", name, tensor, state);
    for (const auto& [name, tensor] : state.optimizer) {
      if (is_step_count(name) && !index.find("optim/" + name)) {
        saved_step_counts = false;
        continue;
      }
      add_state_tensor(targets, "optim/", name, tensor, state);
    }
    for (size_t k = 0; k < state.rng.size(); ++k) {
      const std::string name = rng_name(rank, state.rng[k].first);
      const torch::Tensor& current = state.rng[k].second;
      const TensorInfo* info = index.find(name);
      if (!info ||
          info->shape != std::vector<int64_t>(current.sizes().begin(), current.sizes().end())) {
        log::warn("checkpoint: " + step_dir.string() + " has no " + name +
                  "; that generator keeps its seeded state");
        continue;
      }
      rng_targets.emplace_back(k, targets.size());
      targets.push_back(own_tensor(name, torch::empty_like(current)));
    }
    state.step = saved.at("step").get<int64_t>();
    state.optimizer_steps = saved.at("optimizer_steps").get<int64_t>();
    state.skipped_steps = saved.value("skipped_steps", int64_t{0});
    state.grad_scaler = saved.value("grad_scaler", json(nullptr));  // fp16-mixed's loss scaler
    state.loader = resume_position(state, index, rank);
  } catch (const json::exception& e) {
    error = step_dir.string() + ": training_state is incomplete (" + one_line_error(e) + ")";
  } catch (const std::exception& e) {
    error = step_dir.string() + ": " + one_line_error(e);
  }
  ckpt::agree(comm, error);
  // Exact: every model and optimizer tensor of the checkpoint has its place here and every one
  // here is in the checkpoint (the same on every rank: one index, the ranks' names merged).
  if (const std::string difference =
          ckpt::state_difference(index, ckpt::live_state_shapes(state, comm));
      !difference.empty()) {
    throw ckpt::StateMismatch(step_dir.string() +
                              " holds another training state than this run's (" + difference +
                              "); " + ckpt::state_mismatch_advice());
  }

  LoadOptions load_options;
  load_options.index = &index;
  LoadResult result = load_checkpoint(step_dir, targets, comm, load_options);
  try {
    torch::NoGradGuard no_grad;
    for (const auto& [k, t] : rng_targets) state.rng[k].second = targets[t].tensor;
    if (!saved_step_counts) {  // format 1: one count for every parameter, as it then was
      for (auto& [name, tensor] : state.optimizer) {
        if (is_step_count(name)) tensor.fill_(static_cast<double>(state.optimizer_steps));
      }
    }
    trainer.load_state(state);
  } catch (const std::exception& e) {
    error = step_dir.string() + ": restoring the loaded state failed: " + one_line_error(e);
  }
  ckpt::agree(comm, error);

  const std::string saved_hash = saved.contains("config_hash") && saved["config_hash"].is_string()
                                     ? saved["config_hash"].get<std::string>()
                                     : "?";
  if (!config_hash.empty() && saved_hash != config_hash) {
    log::warn("checkpoint: " + step_dir.string() + " was saved with another config (hash " +
              saved_hash + ", now " + config_hash + ")");
  }
  const json* saved_lr = saved.contains("lr_schedule") && saved["lr_schedule"].is_object() &&
                                 saved["lr_schedule"].contains("next_lr") &&
                                 saved["lr_schedule"]["next_lr"].is_number()
                             ? &saved["lr_schedule"]["next_lr"]
                             : nullptr;
  const double next_lr =
      learning_rate(trainer.optimizer().options(), trainer.train_options().steps, state.step);
  if (saved_lr && saved_lr->get<double>() != next_lr) {
    log::warn(fmt::format(
        "checkpoint: the learning-rate schedule changed: step {} had lr {} when saved, the config "
        "now gives {}",
        state.step + 1, saved_lr->get<double>(), next_lr));
  }
  log::info(fmt::format("resumed from {} at step {} (epoch {}, batch {})", step_dir.string(),
                        state.step, state.loader.epoch, state.loader.batch));
  return result;
}

// Why saving checkpoints into `dir` must not start: a fresh start (no `resumed_step`) into a
// directory holding committed checkpoints, or a resume from a step older than some of them. Either
// would mix two histories in one directory, and retention (newest steps first) would then remove
// the new saves or the old ones. "" when starting is safe.
std::string start_problem(const std::filesystem::path& dir, std::optional<int64_t> resumed_step) {
  std::vector<int64_t> steps;
  for (const auto& entry : list_checkpoints(dir)) {
    if (entry.committed) steps.push_back(entry.step);
  }
  if (steps.empty()) return "";
  if (!resumed_step) {
    return fmt::format(
        "checkpoint.dir {} holds committed checkpoints up to step {} of an earlier run; continue "
        "it with --resume auto, or set checkpoint.dir or run.name to start afresh",
        dir.string(), steps.back());
  }
  std::vector<std::string> newer;
  for (int64_t s : steps) {
    if (s > *resumed_step) newer.push_back((dir / ckpt::step_dir_name(s)).string());
  }
  if (newer.empty()) return "";
  return fmt::format(
      "resuming at step {}, but checkpoint.dir {} holds newer checkpoints ({}); the run's new "
      "saves "
      "would mix with them and retention could remove them: move them out of that directory to "
      "resume from step {} (`kiln ckpt verify` tells whether they load), or set checkpoint.dir "
      "to another directory",
      *resumed_step, dir.string(), fmt::join(newer, ", "), *resumed_step);
}

}  // namespace

SaveRequest capture_training_state(Trainer& trainer, Communicator& comm,
                                   const CheckpointRecord& record) {
  const std::filesystem::path& manifest = record.manifest;
  const int rank = comm.rank();
  TrainState state = trainer.state();
  SaveRequest request;
  request.step = state.step;
  // Parameters and optimizer state change only in the optimizer step, which the CheckpointHook
  // fences; buffers are copied now: a forward pass may update them (batch-norm statistics)
  // before a background save has staged them.
  const size_t buffers = trainer.model().named_buffers().size();
  const size_t parameters = state.model.size() - buffers;
  // A piece another rank saves too (TensorPiece::saved) is left to that rank.
  auto saved_elsewhere = [&](const std::string& name) {
    auto piece = state.pieces.find(name);
    return piece != state.pieces.end() && !piece->second.saved;
  };
  for (size_t k = 0; k < state.model.size(); ++k) {
    const auto& [name, tensor] = state.model[k];
    if (saved_elsewhere(name)) continue;
    torch::NoGradGuard no_grad;
    add_state_tensor(request.tensors, "model/", name, k < parameters ? tensor : tensor.clone(),
                     state);
  }
  for (const auto& [name, tensor] : state.optimizer) {
    if (saved_elsewhere(name)) continue;
    add_state_tensor(request.tensors, "optim/", name, tensor, state);
  }
  json rng = {{"cpu", nullptr}, {"cuda", nullptr}};
  for (const auto& [name, tensor] : state.rng) {
    request.tensors.push_back(own_tensor(rng_name(rank, name), tensor));
    if (name == "cpu") {
      rng["cpu"] = rng_name(rank, name);
    } else {
      if (rng["cuda"].is_null()) rng["cuda"] = json::array();
      rng["cuda"].push_back(rng_name(rank, name));
    }
  }
  request.rank_state = {{"rank", rank},
                        {"loader",
                         {{"epoch", state.loader.epoch},
                          {"batch", state.loader.batch},
                          {"batch_size", state.batch_size},
                          {"world_size", state.world_size},
                          {"batches_per_epoch", state.batches_per_epoch}}},
                        {"rng", std::move(rng)}};
  json manifest_pointer = {{"path", manifest.string()}, {"xxh3", nullptr}};
  std::error_code ec;
  if (!manifest.empty() && std::filesystem::is_regular_file(manifest, ec)) {
    manifest_pointer["xxh3"] = hex64(hash_file(manifest));
  }
  request.training_state = {
      {"step", state.step},
      {"epoch", state.loader.epoch},
      {"optimizer_steps", state.optimizer_steps},
      {"skipped_steps", state.skipped_steps},
      {"lr_schedule", state.lr_schedule},
      {"grad_scaler", state.grad_scaler},
      {"config_hash", record.config_hash},
      {"run_manifest", std::move(manifest_pointer)},
      {"model", trainer.model().architecture()},
      {"optimizer",
       trainer.optimizer().options().kind == OptimOptions::Kind::kAdamW ? "adamw" : "sgd"},
      {"checkpointing", record.settings}};
  return request;
}

std::optional<LoadResult> restore_training_state(Trainer& trainer, Communicator& comm,
                                                 const std::filesystem::path& path,
                                                 bool dir_fallback,
                                                 const std::string& config_hash) {
  if (!dir_fallback) return restore_from(trainer, comm, path, config_hash);
  return ckpt::load_newest(path, comm, [&](const std::filesystem::path& step_dir) {
    return restore_from(trainer, comm, step_dir, config_hash);
  });
}

// ---- CheckpointHook ----------------------------------------------------------------------------

CheckpointHook::CheckpointHook(const TrainingCheckpointOptions& options, Communicator& comm)
    : every_steps_(options.every_steps),
      save_final_(options.save_final),
      stop_on_error_(options.stop_on_error),
      comm_(comm),
      record_(options.record),
      checkpointer_(options.store, comm) {}

std::string checkpoint_error_advice(const std::string& error, const std::filesystem::path& dir,
                                    bool continuable) {
  auto caused_by = [&](std::initializer_list<int> codes) {
    for (int code : codes) {
      if (error.find(std::strerror(code)) != std::string::npos) return true;
    }
    return false;
  };
  const std::string cont = " or set checkpoint.on_save_error = \"continue\"";
  if (caused_by({ENOSPC, EDQUOT}))
    return "free space in " + dir.string() + (continuable ? cont : "");
  if (caused_by({EFBIG})) {
    return "a file-size limit (ulimit -f) stopped the write: raise it, or free space in " +
           dir.string() + (continuable ? cont : "");
  }
  if (caused_by({EACCES, EPERM, EROFS})) {
    return "kiln may not write in " + dir.string() +
           ": check its permissions and that its file system is mounted writable, or set "
           "checkpoint.dir";
  }
  if (caused_by({ENOENT})) {
    return "another process removed a file or directory kiln had created in " + dir.string() +
           ": is a second run using this directory? Give each run its own run.name or "
           "checkpoint.dir";
  }
  return "check " + dir.string() +
         (continuable ? " or set checkpoint.on_save_error = \"continue\"" : "");
}

void CheckpointHook::check() {
  while (checked_ < saves_.size() && saves_[checked_]->finished()) {
    const auto& handle = saves_[checked_++];
    if (handle->committed()) continue;
    if (stop_on_error_) {
      throw TrainingError(handle->error() + "; the previous checkpoints are intact; " +
                          checkpoint_error_advice(handle->error(), checkpointer_.options().dir,
                                                  /*continuable=*/true));
    }
    log::warn("checkpoint: training continues without the step " + std::to_string(handle->step()) +
              " checkpoint (checkpoint.on_save_error = \"continue\")");
  }
}

void CheckpointHook::save(Trainer& trainer) {
  checkpointer_
      .wait();  // at most one save in flight; its failure is acted on before the next starts
  check();
  saves_.push_back(checkpointer_.save(capture_training_state(trainer, comm_, record_)));
  last_saved_step_ = trainer.step();
}

void CheckpointHook::save_now(Trainer& trainer) {
  PhaseScope phase(trainer, Phase::kCheckpoint);
  checkpointer_.wait();
  check();
  if (last_saved_step_ != trainer.step()) save(trainer);
  checkpointer_.wait();
  check();
}

void CheckpointHook::on_train_begin(Trainer& trainer) {
  // A resumed run starts at the step of the checkpoint it came from: no need to save that again.
  if (trainer.step() > 0 && last_saved_step_ < 0) last_saved_step_ = trainer.step();
}

void CheckpointHook::on_gradients_ready(Trainer& trainer) {
  if (!checkpointer_.in_flight()) return;
  PhaseScope phase(trainer, Phase::kCheckpoint);
  checkpointer_.wait_for_staging();  // the optimizer step is about to change the saved tensors
}

void CheckpointHook::on_step_end(Trainer& trainer, const StepStats&) {
  const bool save_due = every_steps_ > 0 && trainer.step() % every_steps_ == 0;
  // Most steps: no save in flight, none due, every outcome acted on: no checkpoint phase at all
  // (a phase costs every hook's on_phase_begin/end, and a tracked run counts it as checkpoint
  // time).
  if (!save_due && !checkpointer_.in_flight() && checked_ == saves_.size()) return;
  PhaseScope phase(trainer, Phase::kCheckpoint);
  checkpointer_.poll();
  check();
  if (save_due) {
    save(trainer);
    check();
  }
}

void CheckpointHook::on_train_end(Trainer& trainer) {
  PhaseScope phase(trainer, Phase::kCheckpoint);
  if (save_final_ && every_steps_ > 0 && last_saved_step_ != trainer.step()) save(trainer);
  checkpointer_.wait();
  check();
}

// ---- PreemptionHook ----------------------------------------------------------------------------

PreemptionHook::PreemptionHook(Communicator& comm, std::shared_ptr<CheckpointHook> checkpoints)
    : comm_(comm), checkpoints_(std::move(checkpoints)) {}

// At the start of a step, so that every hook (the metrics record in particular) has seen the
// previous one.
void PreemptionHook::on_step_begin(Trainer& trainer, int64_t) {
  int signal = stop_signal();
  if (comm_.world_size() > 1) {  // every rank stops after the same step
    int agreed = 0;
    for (const auto& text : comm_.all_gather_bytes(std::to_string(signal))) {
      if (agreed == 0) agreed = std::stoi(text);
    }
    signal = agreed;
  }
  if (signal == 0) return;
  log::warn(fmt::format("{} asked the run to stop: it stops after step {}{}",
                        stop_signal_name(signal), trainer.step(),
                        checkpoints_ ? "; committing a checkpoint of it" : " (no checkpointing)"));
  if (checkpoints_) checkpoints_->save_now(trainer);
  throw Preempted(fmt::format(
      "stopped at step {} on {}{}; exit status {}: continue with --resume auto", trainer.step(),
      stop_signal_name(signal),
      checkpoints_ ? ", checkpoint step-" + std::to_string(trainer.step()) + " committed"
                   : " (checkpoint.every_steps = 0: nothing saved)",
      kExitPreempted));
}

std::shared_ptr<PreemptionHook> attach_preemption(Trainer& trainer, Communicator& comm,
                                                  std::shared_ptr<CheckpointHook> checkpoints,
                                                  int timeout_seconds) {
  install_stop_signals(timeout_seconds);
  auto hook = std::make_shared<PreemptionHook>(comm, std::move(checkpoints));
  trainer.add_hook(hook);
  return hook;
}

void check_train_start(const ResumePlan& plan, const TrainingCheckpointOptions& options,
                       Model& model, const OptimOptions& optim) {
  const std::filesystem::path& dir = options.store.dir;
  const bool saving = options.every_steps > 0;
  if (plan.argument.empty()) {
    if (saving) {
      if (std::string problem = start_problem(dir, std::nullopt); !problem.empty())
        throw UserError(problem);
    }
    return;
  }
  if (!plan.index) return;  // a fresh start (auto, none), or no index reads: the load says why
  // The checkpoint it loads first must hold exactly the training state this run builds.
  if (const std::string difference =
          ckpt::state_difference(*plan.index, ckpt::model_state_shapes(model, optim));
      !difference.empty()) {
    throw UserError("--resume " + plan.argument + ": " + plan.step_dir->string() +
                    " holds another training state than this config builds (" + difference + "); " +
                    ckpt::state_mismatch_advice());
  }
  if (saving && plan.exact) {
    if (std::string problem = start_problem(dir, plan.index->step); !problem.empty())
      throw UserError("--resume " + plan.argument + ": " + problem);
  }
}

std::shared_ptr<CheckpointHook> attach_checkpointing(Trainer& trainer, Communicator& comm,
                                                     const TrainingCheckpointOptions& options,
                                                     const ResumePlan& plan) {
  const std::string& resume = plan.argument;
  const std::string& hash = options.record.config_hash;
  std::optional<LoadResult> loaded;
  if (plan.exact) {
    loaded = restore_from(trainer, comm, *plan.step_dir, hash, &*plan.index);
  } else if (!resume.empty()) {
    // The located checkpoint first (its index already read); past a damaged one, the older ones.
    // Every rank located the same one (the same files); rank 0's listing decides the fallback.
    std::string first_error;
    if (plan.step_dir) {
      try {
        loaded = restore_from(trainer, comm, *plan.step_dir, hash, &*plan.index);
      } catch (const ckpt::StateMismatch&) {
        throw;
      } catch (const UserError& e) {  // agreed on every rank
        first_error = e.what();
        log::warn("checkpoint: cannot load " + plan.step_dir->string() + ": " + e.what() +
                  "; falling back to the previous checkpoint");
      }
    }
    if (!loaded) {
      loaded = ckpt::load_newest(plan.search, comm, [&](const std::filesystem::path& step_dir) {
        if (plan.step_dir && step_dir == *plan.step_dir)
          throw UserError(first_error);  // tried above: on to the older ones
        return restore_from(trainer, comm, step_dir, hash);
      });
    }
    if (!loaded) {
      if (resume != "auto") {
        throw UserError("--resume " + resume +
                        ": holds no committed checkpoint (no index.json, no step-<N>/)");
      }
      log::info("--resume auto: no checkpoint in " + options.store.dir.string() +
                "; training starts at step 0");
    }
  }
  if (options.every_steps <= 0) {
    if (loaded && comm.rank() == 0) {
      log::warn(fmt::format(
          "--resume: this run saves no checkpoints (checkpoint.every_steps = 0), though {} holds "
          "them up to step {}; set checkpoint.every_steps to keep saving",
          options.store.dir.string(), loaded->index.step));
    }
    return nullptr;
  }
  // Saving must not mix with (and prune) checkpoints of another history: rank 0's listing decides.
  std::string error;
  if (comm.rank() == 0) {
    try {
      error = start_problem(options.store.dir,
                            loaded ? std::optional<int64_t>(loaded->index.step) : std::nullopt);
      if (!error.empty() && !resume.empty()) error = "--resume " + resume + ": " + error;
    } catch (const std::exception& e) {
      error = one_line_error(e);
    }
  }
  ckpt::agree(comm, error);
  auto hook = std::make_shared<CheckpointHook>(options, comm);
  trainer.add_hook(hook);
  return hook;
}

}  // namespace kiln
