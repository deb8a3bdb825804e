// Retention: which committed checkpoints a directory keeps (keep_last_k, keep_every).
#include <algorithm>

#include "ckpt/saving.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {
namespace ckpt {

std::vector<std::filesystem::path> prune(const std::filesystem::path& dir, int64_t keep_last_k,
                                         int64_t keep_every, int64_t just_committed) {
  std::vector<CheckpointEntry> committed;
  for (auto& entry : list_checkpoints(dir)) {
    if (entry.committed) committed.push_back(std::move(entry));
  }
  std::vector<std::filesystem::path> removed;
  const int64_t n = static_cast<int64_t>(committed.size());
  // The newest keep_last_k (at least the newest one) are kept.
  for (int64_t k = 0; k + std::max<int64_t>(keep_last_k, 1) < n; ++k) {
    const auto& entry = committed[static_cast<size_t>(k)];
    if (keep_every > 0 && entry.step % keep_every == 0) continue;
    if (entry.step == just_committed) continue;
    std::error_code ec;
    std::filesystem::remove_all(entry.path, ec);
    if (ec) throw UserError("cannot remove " + entry.path.string() + ": " + ec.message());
    removed.push_back(entry.path);
  }
  return removed;
}

void apply_retention(const CheckpointOptions& options, int64_t step) {
  try {
    for (const auto& removed : prune(options.dir, options.keep_last_k, options.keep_every, step)) {
      log::info("checkpoint: removed " + removed.string() +
                " (retention: keep_last_k = " + std::to_string(options.keep_last_k) +
                ", keep_every = " + std::to_string(options.keep_every) + ")");
    }
  } catch (const std::exception& e) {
    log::warn("checkpoint: retention failed (checkpoints kept): " + one_line_error(e));
  }
}

}  // namespace ckpt

std::vector<std::filesystem::path> prune_checkpoints(const std::filesystem::path& dir,
                                                     int64_t keep_last_k, int64_t keep_every) {
  return ckpt::prune(dir, keep_last_k, keep_every, /*just_committed=*/-1);
}

}  // namespace kiln
