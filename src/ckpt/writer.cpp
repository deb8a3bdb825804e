// The writer job: the background thread of a save stages the tensors to CPU (background_staging),
// writes and fsyncs this rank's file into step-<N>.tmp/, and on rank 0 commits once told to (in a
// one-process world at once: Job::solo).
#include <torch/cuda.h>

#include <cstring>

#include "ckpt/saving.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/safetensors.h"

namespace kiln {
namespace ckpt {

std::vector<std::pair<std::string, torch::Tensor>> stage(
    std::vector<torch::Tensor>& buffers,
    const std::vector<std::pair<std::string, torch::Tensor>>& live) {
  torch::NoGradGuard no_grad;
  if (buffers.size() < live.size()) buffers.resize(live.size());
  std::vector<std::pair<std::string, torch::Tensor>> out;
  bool any_cuda = false;
  for (size_t k = 0; k < live.size(); ++k) {
    const torch::Tensor& source = live[k].second;
    torch::Tensor& buffer = buffers[k];
    if (!buffer.defined() || buffer.sizes() != source.sizes() ||
        buffer.scalar_type() != source.scalar_type()) {
      buffer = torch::empty(
          source.sizes(),
          torch::TensorOptions().dtype(source.scalar_type()).pinned_memory(source.is_cuda()));
    }
    if (source.is_cpu() && source.is_contiguous()) {
      if (source.nbytes() > 0) std::memcpy(buffer.data_ptr(), source.data_ptr(), source.nbytes());
    } else {
      buffer.copy_(source, /*non_blocking=*/source.is_cuda());
      any_cuda = any_cuda || source.is_cuda();
    }
    out.emplace_back(live[k].first, buffer);
  }
  if (any_cuda) torch::cuda::synchronize();
  return out;
}

}  // namespace ckpt

using Kind = ckpt::SaveStatus::Kind;

void Checkpointer::Job::run(std::stop_token stop) {
  if (!sources.empty() || !staged) {
    const auto staging_begin = SteadyClock::now();
    std::string error;
    try {
      tensors = ckpt::stage(*staging, sources);
    } catch (const std::exception& e) {
      error = "staging failed: " + one_line_error(e);
    }
    sources.clear();
    {
      std::lock_guard lock(mutex);
      staged = true;
      staging_seconds = seconds_since(staging_begin);
      if (!error.empty()) status = {Kind::kFailed, error, 0};
    }
    cv.notify_all();
    if (!error.empty()) return;
  }
  const auto start = SteadyClock::now();
  bool written = false;
  try {
    const std::string file = ckpt::rank_file_name(rank);
    // One level only: the checkpoint directory exists (the Checkpointer created it); if another
    // process removed it, ENOENT says so instead of a fresh directory hiding it.
    std::error_code ec;
    std::filesystem::create_directory(tmp_dir, ec);
    if (ec) throw UserError("cannot create " + tmp_dir.string() + ": " + ec.message());
    SafetensorsWriteResult result = write_safetensors(tmp_dir / file, tensors, metadata);
    nlohmann::json info = {
        {"file", file}, {"size_bytes", result.size_bytes}, {"xxh3", hex64(result.xxh3)}};
    nlohmann::json ranges = nlohmann::json::object();
    for (size_t k = 0; k < tensors.size(); ++k) {
      ranges[tensors[k].first] = {result.tensor_byte_ranges[k].first,
                                  result.tensor_byte_ranges[k].second};
    }
    info["ranges"] = std::move(ranges);
    std::lock_guard lock(mutex);
    status = {Kind::kWritten, info.dump(), 0};
    if (solo && !stop.stop_requested()) {  // the decision the exchange would make, made here
      gathered = {status};
      commit_requested = true;
      status = {Kind::kCommitting, "", 0};
    }
    bytes_written = result.size_bytes;
    write_seconds = seconds_since(start);
    written = true;
  } catch (const std::exception& e) {
    std::lock_guard lock(mutex);
    status = {Kind::kFailed, one_line_error(e), 0};
    write_seconds = seconds_since(start);
  }
  tensors.clear();  // drop the references to the staged (or live) tensors
  cv.notify_all();
  if (rank != 0 || !written) return;
  {
    std::unique_lock lock(mutex);
    // A stop (the save resolved without a commit, or the Checkpointer shuts down) ends the wait.
    cv.wait(lock, stop, [&] { return commit_requested; });
    if (stop.stop_requested()) return;
  }
  std::string error;
  uint64_t total = 0;
  try {
    total = commit();
  } catch (const std::exception& e) {
    error = one_line_error(e);
  }
  {
    std::lock_guard lock(mutex);
    status = error.empty() ? ckpt::SaveStatus{Kind::kCommitted, "", total}
                           : ckpt::SaveStatus{Kind::kCommitFailed, error, 0};
  }
  cv.notify_all();
}

}  // namespace kiln
