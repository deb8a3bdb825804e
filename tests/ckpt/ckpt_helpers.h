// Helpers for the checkpoint tests: damaging files, a small disk, child processes.
#pragma once

#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/internal.h"
#include "core/process.h"
#include "support/helpers.h"

namespace kiln::testing {

/// Flips one bit of the byte at `offset` (from the end when negative).
inline void flip_byte(const std::filesystem::path& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  const auto size = static_cast<int64_t>(std::filesystem::file_size(path));
  const int64_t at = offset >= 0 ? offset : size + offset;
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(at);
  f.write(&c, 1);
}

inline void truncate_file(const std::filesystem::path& path, uint64_t drop_bytes) {
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - drop_bytes);
}

/// A small tmpfs mounted at a fresh directory (needs CAP_SYS_ADMIN, e.g. root in CI), unmounted
/// at scope exit. mounted() is false when the mount was refused; why() says why.
class SmallDisk {
 public:
  explicit SmallDisk(uint64_t size_bytes) {
    const std::string options = "size=" + std::to_string(size_bytes);
    std::filesystem::create_directories(dir_.path() / "disk");
    if (::mount("tmpfs", (dir_.path() / "disk").c_str(), "tmpfs", 0, options.c_str()) == 0) {
      mounted_ = true;
    } else {
      why_ = std::strerror(errno);
    }
  }
  ~SmallDisk() {
    if (mounted_) ::umount2((dir_.path() / "disk").c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& why() const { return why_; }
  std::filesystem::path path() const { return dir_.path() / "disk"; }

 private:
  TempDir dir_;
  bool mounted_ = false;
  std::string why_;
};

/// A child process running the kiln CLI with `args`, output to `log`; optional file-size limit
/// (RLIMIT_FSIZE, with SIGXFSZ ignored so writes fail with EFBIG instead of killing it). Started
/// with posix_spawn (spawn_process): nothing runs between fork and exec in this multithreaded test
/// process. The child inherits the limit and the ignored signal from this process, so both are set
/// here around the spawn only (the soft limit; SIGXFSZ stays ignored, harmless for the tests).
class KilnProcess {
 public:
  KilnProcess(const std::vector<std::string>& args, const std::filesystem::path& log,
              uint64_t file_size_limit = 0) {
    std::vector<std::string> argv = {KILN_CLI};
    argv.insert(argv.end(), args.begin(), args.end());
    if (file_size_limit == 0) {
      pid_ = spawn_process(argv, log);
      return;
    }
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit saved {};
    ::getrlimit(RLIMIT_FSIZE, &saved);
    struct rlimit limit = saved;
    limit.rlim_cur = std::min<rlim_t>(file_size_limit, saved.rlim_max);
    ::setrlimit(RLIMIT_FSIZE, &limit);
    try {
      pid_ = spawn_process(argv, log);
    } catch (...) {
      ::setrlimit(RLIMIT_FSIZE, &saved);
      throw;
    }
    ::setrlimit(RLIMIT_FSIZE, &saved);
  }
  ~KilnProcess() {
    if (pid_ > 0 && !done_) {
      ::kill(pid_, SIGKILL);
      wait();
    }
  }
  pid_t pid() const { return pid_; }
  /// Exit status, or 128 + signal.
  int wait() {
    if (done_) return status_;
    status_ = wait_process(pid_);
    done_ = true;
    return status_;
  }
  /// True (and the status recorded) when the child has exited.
  bool exited() {
    if (done_) return true;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) != pid_) return false;
    done_ = true;
    status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return true;
  }
  void kill_now() {
    ::kill(pid_, SIGKILL);
    wait();
  }

 private:
  pid_t pid_ = -1;
  bool done_ = false;
  int status_ = -1;
};

/// The `--set` arguments for a small, fast MLP run in `dir`/`name`.
inline std::vector<std::string> mlp_train_args(const std::filesystem::path& dir,
                                               const std::string& name,
                                               const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"train", (source_dir() / "configs/mlp.toml").string(),
                                   "--set", "run.dir=" + dir.string(),
                                   "--set", "run.name=" + name,
                                   "--set", "run.progress=log",
                                   "--set", "run.log_every=1000",
                                   "--set", "data.num_samples=256",
                                   "--set", "data.val_samples=64",
                                   "--set", "train.eval_every=0",
                                   "--set", "train.eval_batches=1",
                                   "--set", "run.threads=1"};
  for (const auto& e : extra) {
    args.push_back("--set");
    args.push_back(e);
  }
  return args;
}

}  // namespace kiln::testing
