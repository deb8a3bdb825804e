// The Checkpointer: agrees on a save across ranks, hands it to a background writer job, drives
// it to a commit or a failure with a small status exchange per poll, and resolves its SaveHandle.
// The pieces it drives live beside it (see ckpt/saving.h).
#include <fmt/format.h>

#include <chrono>

#include "ckpt/saving.h"
#include "core/clock.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {
namespace {

using nlohmann::json;
using Clock = SteadyClock;
using Kind = ckpt::SaveStatus::Kind;

// Blocking waits for a save poll the other ranks this often (see Checkpointer::advance).
constexpr std::chrono::milliseconds kBlockingSlice{50};

}  // namespace

// ---- SaveHandle --------------------------------------------------------------------------------

bool SaveHandle::finished() const {
  std::lock_guard lock(mutex_);
  return finished_;
}
bool SaveHandle::committed() const {
  std::lock_guard lock(mutex_);
  return committed_;
}
std::string SaveHandle::error() const {
  std::lock_guard lock(mutex_);
  return error_;
}
void SaveHandle::rethrow_if_failed() const {
  std::lock_guard lock(mutex_);
  if (finished_ && !committed_) throw UserError(error_);
}
SaveStats SaveHandle::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

// ---- Checkpointer ------------------------------------------------------------------------------

Checkpointer::Checkpointer(CheckpointOptions options, Communicator& comm)
    : options_(std::move(options)), comm_(comm) {
  if (options_.keep_last_k < 2) {
    throw UserError("checkpoint.keep_last_k = " + std::to_string(options_.keep_last_k) +
                    " must be >= 2 (a checkpoint being written must never be the only one)");
  }
  std::string error;
  if (comm_.rank() == 0) {
    try {
      std::error_code ec;
      std::filesystem::create_directories(options_.dir, ec);
      if (ec)
        throw UserError("cannot create checkpoint directory " + options_.dir.string() + ": " +
                        ec.message());
      ckpt::recover_interrupted_commits(options_.dir);
    } catch (const std::exception& e) {
      error = one_line_error(e);
    }
  }
  ckpt::agree(comm_, error);
}

Checkpointer::~Checkpointer() {
  if (!job_) return;
  job_->finish_thread();
  // Rank 0's thread finishes a commit it had started; only rank 0 knows the outcome.
  const std::string step = std::to_string(job_->step);
  if (comm_.rank() != 0) {
    if (job_->status.kind != Kind::kWritten) {
      log::warn("checkpoint: this rank's part of the save of step " + step +
                " was not written (abandoned)");
    }
    return;
  }
  if (job_->status.kind == Kind::kCommitted) {
    log::info("checkpoint: step-" + step + " committed while the checkpointer shut down");
    return;
  }
  ckpt::remove_quietly(job_->tmp_dir);
  log::warn("checkpoint: the save of step " + step + " was not committed (abandoned)");
}

std::shared_ptr<const SaveHandle> Checkpointer::save(SaveRequest request) {
  const auto begin = Clock::now();
  wait();
  const double wait_previous = seconds_since(begin);
  const int rank = comm_.rank(), world = comm_.world_size();

  // 1. Agree on what is saved.
  json mine;
  try {
    mine = ckpt::describe_request(request, rank);
  } catch (const std::exception& e) {
    mine = {{"step", request.step}, {"error", one_line_error(e)}};
  }
  std::vector<json> descs;
  for (const auto& text : comm_.all_gather_bytes(mine.dump())) descs.push_back(json::parse(text));
  if (std::string problem = ckpt::check_descriptions(descs); !problem.empty())
    throw UserError(problem);

  // 2. Every rank's writer thread creates step-<N>.tmp/ (idempotent), so no further round trip is
  // needed here; stale .tmp directories were removed when the Checkpointer started, failed saves
  // remove theirs.
  const std::filesystem::path tmp_dir = options_.dir / ckpt::tmp_dir_name(request.step);

  // 3. What this rank writes: its share of the replicated tensors and its own pieces.
  const ckpt::SavePlan plan = ckpt::plan_save(request, descs, rank);

  auto job = std::make_unique<Job>();
  job->handle = std::shared_ptr<SaveHandle>(new SaveHandle(request.step));
  job->step = request.step;
  job->rank = rank;
  job->solo = world == 1;
  job->options = options_;
  job->tmp_dir = tmp_dir;
  job->final_dir = options_.dir / ckpt::step_dir_name(request.step);
  job->begin = begin;
  job->metadata = {{"format", ckpt::kFormatName},
                   {"format_version", std::to_string(kCheckpointFormatVersion)},
                   {"step", std::to_string(request.step)},
                   {"rank", std::to_string(rank)},
                   {"world_size", std::to_string(world)}};

  // 4. Staging. Sync saves write the live CPU tensors (training waits). Async saves copy them to
  // CPU buffers reused across saves (pinned for CUDA) so training may change the live tensors:
  // here, or with background_staging in the writer thread before it writes (wait_for_staging()
  // fences the caller's next change of them).
  std::vector<std::pair<std::string, torch::Tensor>> live;
  for (const auto* t : plan.to_write) live.emplace_back(t->stored_name(), t->tensor.detach());
  double staging_seconds = 0;
  if (!options_.async) {
    for (auto& [name, tensor] : live)
      job->tensors.emplace_back(name, tensor.to(torch::kCPU).contiguous());
  } else if (options_.background_staging) {
    job->sources = std::move(live);
    job->staging = &staging_;
    job->staged = false;
  } else {
    const auto staging_begin = Clock::now();
    job->tensors = ckpt::stage(staging_, live);
    staging_seconds = seconds_since(staging_begin);
  }

  // 5. Rank 0 drafts the index (files and byte ranges are filled in at commit).
  if (rank == 0) job->index = ckpt::draft_index(request, plan, descs);

  // 6. Write in the background; a sync save waits for the commit here.
  {
    std::lock_guard lock(job->handle->mutex_);
    job->handle->stats_.wait_previous_seconds = wait_previous;
    job->handle->stats_.staging_seconds = staging_seconds;
  }
  Job* raw = job.get();
  job->thread = std::jthread([raw](std::stop_token stop) { raw->run(std::move(stop)); });
  job_ = std::move(job);
  last_ = job_->handle;
  auto handle = last_;
  if (!options_.async) advance(/*blocking=*/true);
  {
    std::lock_guard lock(handle->mutex_);
    handle->stats_.stall_seconds = seconds_since(begin);
  }
  return handle;
}

double Checkpointer::wait_for_staging() {
  if (!job_) return 0;
  const auto begin = Clock::now();
  std::unique_lock lock(job_->mutex);
  job_->cv.wait(lock, [&] { return job_->staged; });
  return seconds_since(begin);
}

void Checkpointer::poll() {
  if (job_) advance(/*blocking=*/false);
}

void Checkpointer::wait() {
  if (!job_) return;
  const auto begin = Clock::now();
  const int64_t step = job_->step;
  advance(/*blocking=*/true);
  log::info(fmt::format("checkpoint: waited {} for the save of step {} to finish",
                        format_duration(seconds_since(begin)), step));
}

void Checkpointer::advance(bool blocking) {
  while (job_) {
    ckpt::SaveStatus mine;
    {
      std::unique_lock lock(job_->mutex);
      if (blocking) {
        // Wait locally for at most a slice, then exchange statuses (again and again): every rank
        // reaches each all-gather within a slice of the others, so a rank whose write takes
        // longer than dist.timeout_seconds never leaves the others blocked in a collective.
        job_->cv.wait_for(lock, kBlockingSlice, [&] {
          return job_->status.kind != Kind::kWriting && job_->status.kind != Kind::kCommitting;
        });
      }
      mine = job_->status;
    }
    std::vector<ckpt::SaveStatus> all;
    const std::vector<std::string> gathered =
        comm_.all_gather_bytes(ckpt::encode_save_status(mine));
    for (size_t r = 0; r < gathered.size(); ++r)
      all.push_back(ckpt::decode_save_status(gathered[r], static_cast<int>(r)));
    // Every rank decides from the same gathered statuses, so all resolve at the same call.
    const ckpt::SaveDecision decision = ckpt::decide_save(all, job_->step);
    switch (decision.action) {
      case ckpt::SaveDecision::Action::kCommitted:
        resolve("", decision.total_bytes);
        return;
      case ckpt::SaveDecision::Action::kFailed:
        resolve(decision.error, 0);
        return;
      case ckpt::SaveDecision::Action::kCommit:
        if (comm_.rank() == 0) {
          std::lock_guard lock(job_->mutex);
          job_->gathered = std::move(all);
          job_->commit_requested = true;
          job_->status = {Kind::kCommitting, "", 0};
        }
        job_->cv.notify_all();
        break;
      case ckpt::SaveDecision::Action::kWait:
        break;
    }
    if (!blocking) return;
  }
}

void Checkpointer::resolve(const std::string& error, uint64_t total_bytes) {
  job_->finish_thread();  // rank 0's thread may still wait for a commit decision
  if (!error.empty() && comm_.rank() == 0) ckpt::remove_quietly(job_->tmp_dir);
  const double total_seconds = seconds_since(job_->begin);
  {
    auto& h = *job_->handle;
    std::lock_guard lock(h.mutex_);
    h.finished_ = true;
    h.committed_ = error.empty();
    h.error_ = error.empty() ? "" : "checkpoint step " + std::to_string(job_->step) + ": " + error;
    h.stats_.bytes_written = job_->bytes_written;
    h.stats_.total_bytes = total_bytes;
    h.stats_.write_seconds = job_->write_seconds;
    if (options_.background_staging) h.stats_.staging_seconds = job_->staging_seconds;
    h.stats_.total_seconds = total_seconds;
  }
  if (error.empty()) {
    if (comm_.rank() == 0) {
      log::info(fmt::format("checkpoint: step-{} committed ({} in {})", job_->step,
                            format_bytes(static_cast<double>(total_bytes)),
                            format_duration(total_seconds)));
    }
  } else {
    log::error(job_->handle->error());
  }
  job_.reset();
}

}  // namespace kiln
