// Test helpers: temporary directories, running the kiln CLI, small configs.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kiln/config.h"

namespace kiln::testing {

/// A fresh directory under the system temp dir, removed at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "kiln-test-XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

/// An exclusive flock(2) on `path` for the scope: a cache shared by the test processes of a build
/// (a package, a prepared dataset) filled by whichever gets there first. Released when the scope
/// ends, by an exception too, so a failed fill fails its test and not the next one's lock.
class FileLock {
 public:
  explicit FileLock(const std::filesystem::path& path)
      : fd_(::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644)) {
    if (fd_ < 0) throw std::runtime_error("cannot open the lock file " + path.string());
    while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  ~FileLock() {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
};

struct CommandResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

inline std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

inline void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

/// Runs a shell command, capturing stdout and stderr separately.
inline CommandResult run_shell(const std::string& command) {
  TempDir dir;
  const std::string full = command + " >" + (dir / "out").string() + " 2>" + (dir / "err").string();
  int status = std::system(full.c_str());
  CommandResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.out = slurp(dir / "out");
  result.err = slurp(dir / "err");
  return result;
}

/// Runs the kiln CLI built alongside the tests with `args` (already shell-quoted where needed).
inline CommandResult run_kiln(const std::string& args) {
  return run_shell(std::string(KILN_CLI) + " " + args);
}

inline std::filesystem::path source_dir() {
  return KILN_SOURCE_DIR;
}

/// A small, fast MLP config writing into `run_dir`.
inline Config mlp_config(const std::filesystem::path& run_dir,
                         const std::vector<std::string>& extra = {}) {
  std::vector<std::string> overrides = {
      "run.dir=" + run_dir.string(), "run.name=t",           "run.progress=off",  "train.steps=50",
      "data.num_samples=2048",       "data.val_samples=512", "train.eval_every=0"};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  Config config = Config::defaults();
  for (const auto& o : overrides) config.set_from_string(o);
  config.validate();
  return config;
}

/// A small GPT on the bundled-text default corpus, writing into `run_dir`.
inline Config gpt_config(const std::filesystem::path& run_dir,
                         const std::vector<std::string>& extra = {}) {
  std::vector<std::string> overrides = {"run.dir=" + run_dir.string(),
                                        "run.name=t",
                                        "run.progress=off",
                                        "model.name=gpt",
                                        "model.n_layer=2",
                                        "model.n_embd=64",
                                        "model.n_head=4",
                                        "data.name=text",
                                        "data.seq_len=32",
                                        "train.batch_size=8",
                                        "train.steps=20",
                                        "train.eval_every=0",
                                        "train.eval_batches=2",
                                        "optim.lr=3e-3"};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  Config config = Config::defaults();
  for (const auto& o : overrides) config.set_from_string(o);
  config.validate();
  return config;
}

}  // namespace kiln::testing
