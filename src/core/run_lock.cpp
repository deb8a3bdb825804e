// One writer per directory: flock(2) on <dir>/.kiln-lock, shared within a process, handed to the
// children a holder starts (KILN_RUN_LOCK). See kiln/run.h for the contract.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/counters.h"
#include "core/files.h"
#include "core/process.h"
#include "kiln/error.h"
#include "kiln/run.h"

namespace kiln {

struct RunLock::Held {
  std::filesystem::path dir;  // absolute, normalized
  FileDescriptor fd;          // holds the flock; O_CLOEXEC, so children never inherit it
};

namespace {

using nlohmann::json;

struct Registry {
  std::mutex mutex;
  std::vector<std::weak_ptr<RunLock::Held>> held;
};

Registry& registry() {
  static Registry r;
  return r;
}

std::filesystem::path normalized(const std::filesystem::path& dir) {
  std::error_code ec;
  auto absolute = std::filesystem::absolute(dir, ec);
  if (ec) absolute = dir;
  auto out = std::filesystem::weakly_canonical(absolute, ec);
  if (ec) out = absolute.lexically_normal();
  // No trailing separator: "a/b/" and "a/b" are one directory.
  if (!out.has_filename() && out.has_parent_path() && out != out.root_path())
    out = out.parent_path();
  return out;
}

// Whether `dir` is `root` or lies inside it (both normalized).
bool within(const std::filesystem::path& dir, const std::filesystem::path& root) {
  auto d = dir.begin();
  for (auto r = root.begin(); r != root.end(); ++r, ++d) {
    if (d == dir.end() || *d != *r) return false;
  }
  return true;
}

std::string describe_since(int64_t unix_seconds) {
  const std::time_t t = static_cast<std::time_t>(unix_seconds);
  const std::time_t now = std::time(nullptr);
  std::tm then{}, today{};
  localtime_r(&t, &then);
  localtime_r(&now, &today);
  char buffer[40];
  const bool same_day = then.tm_yday == today.tm_yday && then.tm_year == today.tm_year;
  std::strftime(buffer, sizeof(buffer), same_day ? "%H:%M:%S" : "%Y-%m-%d %H:%M:%S", &then);
  return buffer;
}

// The holder recorded in `fd`'s lock file; null when it is empty or not JSON (a holder that
// locked it a moment ago and has not written it yet).
json read_holder(int fd) {
  std::string text;
  char buffer[4096];
  off_t offset = 0;
  while (true) {
    const ssize_t n = ::pread(fd, buffer, sizeof(buffer), offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
    offset += n;
  }
  json holder = json::parse(text, nullptr, /*allow_exceptions=*/false);
  return holder.is_object() ? holder : json();
}

std::string in_use_message(const LockTarget& target, const std::filesystem::path& dir, int fd) {
  json holder;
  for (int attempt = 0; attempt < 40 && holder.is_null(); ++attempt) {
    holder = read_holder(fd);
    if (holder.is_null()) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  if (holder.is_null()) {
    return fmt::format(
        "{} {} is in use by another process (its lock file {} names no holder); "
        "wait for it, or set {}",
        target.what, target.dir.string(), (dir / kRunLockFile).string(), target.key);
  }
  return fmt::format("{} {} is in use by pid {} on host {} since {} ({}); wait for it, or set {}",
                     target.what, target.dir.string(), holder.value("pid", int64_t{0}),
                     holder.value("host", std::string("?")),
                     describe_since(holder.value("since_unix", int64_t{0})),
                     holder.value("command_line", std::string("?")), target.key);
}

// The lock this process inherited from the process that started it, if any.
struct Inherited {
  int64_t pid = 0;
  std::vector<std::filesystem::path> dirs;
};

std::optional<Inherited> inherited_lock() {
  const char* text = std::getenv(kRunLockEnv);
  if (text == nullptr || *text == '\0') return std::nullopt;
  const json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!value.is_object() || !value.contains("pid") || !value["pid"].is_number_integer() ||
      !value.contains("dirs") || !value["dirs"].is_array()) {
    throw UserError(
        fmt::format("environment variable {} = '{}' is not a kiln lock handoff; unset "
                    "it (kiln sets it for the processes it starts)",
                    kRunLockEnv, text));
  }
  Inherited out;
  out.pid = value["pid"].get<int64_t>();
  for (const auto& dir : value["dirs"]) out.dirs.push_back(normalized(dir.get<std::string>()));
  return out;
}

// Checks that `root`'s lock is still held by `pid` (the parent). Throws UserError otherwise.
void check_inherited(const std::filesystem::path& root, int64_t pid, const LockTarget& target) {
  const auto path = root / kRunLockFile;
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  bool held = false;
  if (fd.valid()) {
    if (::flock(fd.get(), LOCK_SH | LOCK_NB) == 0) {
      ::flock(fd.get(), LOCK_UN);
    } else if (errno == EWOULDBLOCK) {
      held = read_holder(fd.get()).value("pid", int64_t{-1}) == pid;
    }
  }
  if (!held) {
    throw UserError(fmt::format(
        "{} {}: this process was started under the lock of pid {} on {}, which no longer holds "
        "it (the parent process ended); start the command again on its own",
        target.what, target.dir.string(), pid, root.string()));
  }
}

std::shared_ptr<RunLock::Held> take(const LockTarget& target, const std::filesystem::path& dir,
                                    const std::string& command_line) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    throw UserError(fmt::format("cannot create {} {}: {}; set {} to a writable place", target.what,
                                target.dir.string(), ec.message(), target.place_key));
  }
  const auto path = dir / kRunLockFile;
  auto held = std::make_shared<RunLock::Held>();
  held->dir = dir;
  held->fd = FileDescriptor(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!held->fd.valid()) {
    throw UserError(fmt::format("cannot open the lock file {}: {}; check the permissions of {}",
                                path.string(), errno_text(), dir.string()));
  }
  while (::flock(held->fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno == EWOULDBLOCK) throw UserError(in_use_message(target, dir, held->fd.get()));
    throw UserError(fmt::format(
        "cannot lock {}: {}; the file system may not support flock (docs/checkpoint.md, "
        "\"One run per directory\"): put {} on a local or lock-capable file system",
        path.string(), errno_text(), target.what));
  }
  const json holder = {{"pid", static_cast<int64_t>(::getpid())},
                       {"host", hostname()},
                       {"since_utc", utc_now_iso8601()},
                       {"since_unix", static_cast<int64_t>(std::time(nullptr))},
                       {"command_line", command_line}};
  const std::string text = holder.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  // The record is informative: a failure to write it does not give up the lock.
  if (::ftruncate(held->fd.get(), 0) == 0) {
    [[maybe_unused]] const ssize_t n = ::pwrite(held->fd.get(), text.data(), text.size(), 0);
  }
  return held;
}

}  // namespace

RunLock::RunLock(std::vector<std::shared_ptr<Held>> held,
                 std::vector<std::filesystem::path> covered)
    : held_(std::move(held)), covered_(std::move(covered)) {}

RunLock::~RunLock() = default;

std::shared_ptr<RunLock> lock_directories(const std::vector<LockTarget>& targets,
                                          const std::string& command_line) {
  counters::count(counters::Event::kDirectoryLock);
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<std::shared_ptr<RunLock::Held>> held;
  std::vector<std::filesystem::path> covered;
  const std::optional<Inherited> parent = inherited_lock();
  for (const LockTarget& target : targets) {
    const std::filesystem::path dir = normalized(target.dir);
    covered.push_back(dir);
    std::shared_ptr<RunLock::Held> mine;
    for (const auto& weak : r.held) {
      auto h = weak.lock();
      if (h && h->dir == dir) mine = h;
    }
    if (mine) {
      held.push_back(std::move(mine));
      continue;
    }
    if (parent) {
      const std::filesystem::path* root = nullptr;
      for (const auto& d : parent->dirs) {
        if (within(dir, d)) root = &d;
      }
      if (root == nullptr) {
        std::string list;
        for (const auto& d : parent->dirs) list += (list.empty() ? "" : ", ") + d.string();
        throw UserError(fmt::format(
            "{} {} lies outside the directories its parent kiln process (pid {}) holds ({}); a "
            "process started by a kiln run writes only inside them: set {} inside one of them",
            target.what, target.dir.string(), parent->pid, list, target.key));
      }
      check_inherited(*root, parent->pid, target);
      continue;
    }
    auto h = take(target, dir, command_line);
    r.held.push_back(h);
    held.push_back(std::move(h));
  }
  std::erase_if(r.held, [](const auto& weak) { return weak.expired(); });
  return std::make_shared<RunLock>(std::move(held), std::move(covered));
}

std::string run_lock_handoff() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  json dirs = json::array();
  for (const auto& weak : r.held) {
    if (auto h = weak.lock()) dirs.push_back(h->dir.string());
  }
  if (dirs.empty()) {
    const char* inherited = std::getenv(kRunLockEnv);
    return inherited ? inherited : "";
  }
  return json{{"pid", static_cast<int64_t>(::getpid())}, {"dirs", dirs}}.dump(
      -1, ' ', false, json::error_handler_t::replace);
}

}  // namespace kiln
