// Commit and recovery: rank 0 turns a save whose rank files are all durable into a committed
// step-<N> (index.json, the crash-safe rename, latest), and at startup repairs what a killed
// run's commit left half done.
#include <fcntl.h>

#include <cerrno>
#include <cstdio>
#include <map>

#include "ckpt/saving.h"
#include "core/files.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {
namespace ckpt {
namespace {

std::filesystem::path replaced_path(const std::filesystem::path& final_dir) {
  std::filesystem::path replaced = final_dir;
  replaced += ".replaced";
  return replaced;
}

// Makes the finished `tmp_dir` (index written) the committed `final_dir`, durably. When final_dir
// exists (a step saved again, e.g. by a run resumed from an older checkpoint), the two are swapped
// in one atomic renameat2(RENAME_EXCHANGE): at every instant step-<N> is a whole checkpoint, the
// old or the new. Where the file system cannot exchange, the old one is first renamed to
// step-<N>.replaced; a crash before the second rename leaves step-<N>.replaced without step-<N>,
// which the next Checkpointer restores (recover_interrupted_commits).
void publish(const std::filesystem::path& tmp_dir, const std::filesystem::path& final_dir) {
  const std::filesystem::path dir = final_dir.parent_path();
  std::error_code ec;
  if (std::filesystem::exists(final_dir, ec)) {
    if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_directory(dir);
      remove_quietly(tmp_dir);  // now the old checkpoint
      return;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
      throw UserError("cannot exchange " + tmp_dir.string() + " with " + final_dir.string() + ": " +
                      errno_text());
    }
    const std::filesystem::path replaced = replaced_path(final_dir);
    remove_quietly(replaced);
    std::filesystem::rename(final_dir, replaced, ec);
    if (ec) throw UserError("cannot move aside " + final_dir.string() + ": " + ec.message());
    std::filesystem::rename(tmp_dir, final_dir, ec);
    if (ec) {
      std::error_code ignored;
      std::filesystem::rename(replaced, final_dir, ignored);
      throw UserError("cannot rename " + tmp_dir.string() + " to " + final_dir.string() + ": " +
                      ec.message());
    }
    fsync_directory(dir);
    remove_quietly(replaced);
    return;
  }
  std::filesystem::rename(tmp_dir, final_dir, ec);
  if (ec) {
    throw UserError("cannot rename " + tmp_dir.string() + " to " + final_dir.string() + ": " +
                    ec.message());
  }
  fsync_directory(dir);
}

}  // namespace

void remove_quietly(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

void recover_interrupted_commits(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> stale;
  for (const auto& item : std::filesystem::directory_iterator(dir)) {
    const std::string name = item.path().filename().string();
    if (name.rfind("step-", 0) == 0 && name.ends_with(".replaced")) {
      std::filesystem::path final_dir = item.path();
      final_dir.replace_extension();  // step-<N>
      std::error_code ec;
      if (!std::filesystem::exists(final_dir, ec)) {
        std::filesystem::rename(item.path(), final_dir, ec);
        if (ec) {
          throw UserError("cannot restore " + item.path().string() + " to " + final_dir.string() +
                          ": " + ec.message() + "; rename it by hand");
        }
        fsync_directory(dir);
        log::warn("checkpoint: restored " + final_dir.string() + " from " + item.path().string() +
                  " (a run was killed while saving that step again)");
        continue;
      }
    }
    const bool stale_latest = name.rfind(std::string(kLatestFile) + ".tmp.", 0) == 0;
    if (stale_latest ||
        (name.rfind("step-", 0) == 0 && (name.ends_with(".tmp") || name.ends_with(".replaced")))) {
      stale.push_back(item.path());
    }
  }
  for (const auto& path : stale) {
    log::info("checkpoint: removing " + path.string() + " (an unfinished save of an earlier run)");
    remove_quietly(path);
  }
}

}  // namespace ckpt

uint64_t Checkpointer::Job::commit() {
  using nlohmann::json;
  json files = json::array();
  std::map<std::pair<std::string, std::string>, json> ranges;  // (file, name) -> [begin, end]
  uint64_t total = 0;
  for (size_t r = 0; r < gathered.size(); ++r) {
    json info = json::parse(gathered[r].message);
    const std::string file = info["file"].get<std::string>();
    files.push_back(
        {{"name", file}, {"rank", r}, {"size_bytes", info["size_bytes"]}, {"xxh3", info["xxh3"]}});
    total += info["size_bytes"].get<uint64_t>();
    for (const auto& [name, range] : info["ranges"].items()) ranges[{file, name}] = range;
  }
  index["files"] = std::move(files);
  for (auto& [name, tensor] : index["tensors"].items()) {
    for (auto& chunk : tensor["chunks"]) {
      auto it = ranges.find({chunk["file"].get<std::string>(), chunk["name"].get<std::string>()});
      if (it == ranges.end())
        throw UserError("checkpoint: internal error: no byte range for " + name);
      chunk["byte_range"] = it->second;
    }
  }
  write_file_atomic(tmp_dir / ckpt::kIndexFile, ckpt::index_text_with_checksum(index));
  ckpt::publish(tmp_dir, final_dir);
  write_file_atomic(options.dir / ckpt::kLatestFile, ckpt::step_dir_name(step) + "\n");
  ckpt::apply_retention(options, step);
  return total;
}

}  // namespace kiln
