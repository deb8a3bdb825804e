// The capture schedule (torch.profiler.schedule semantics), the [profile] options and the
// trace-directory check.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "core/files.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/profile.h"

namespace kiln {

const char* profiler_action_name(ProfilerAction action) {
  switch (action) {
    case ProfilerAction::kNone:
      return "none";
    case ProfilerAction::kWarmup:
      return "warmup";
    case ProfilerAction::kRecord:
      return "record";
    case ProfilerAction::kRecordAndSave:
      return "record_and_save";
  }
  return "?";
}

ProfilerAction ProfileSchedule::action(int64_t step) const {
  if (step < 0) throw std::invalid_argument("profiler step must be >= 0");
  if (active < 1 || wait < 0 || warmup < 0 || repeat < 0 || skip_first < 0) {
    throw std::invalid_argument("profiler schedule needs active >= 1 and no negative counts");
  }
  if (step < skip_first) return ProfilerAction::kNone;
  step -= skip_first;
  const int64_t cycle = wait + warmup + active;
  if (repeat > 0 && step / cycle >= repeat) return ProfilerAction::kNone;
  const int64_t in_cycle = step % cycle;
  if (in_cycle < wait) return ProfilerAction::kNone;
  if (in_cycle < wait + warmup) return ProfilerAction::kWarmup;
  return in_cycle < cycle - 1 ? ProfilerAction::kRecord : ProfilerAction::kRecordAndSave;
}

int64_t ProfileSchedule::total_steps() const {
  if (repeat == 0) return -1;
  return skip_first + repeat * (wait + warmup + active);
}

void check_trace_directory(const std::filesystem::path& dir) {
  auto fail = [&](const std::string& reason) {
    throw UserError(
        fmt::format("profile.dir: cannot write trace files to {} ({}); choose a writable "
                    "directory with --set profile.dir=<path>",
                    dir.string(), reason));
  };
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail(ec.message());
  if (!std::filesystem::is_directory(dir, ec)) fail("not a directory");
  // Prove it: create, write and remove a probe file (permission bits alone say little as root
  // or on read-only mounts).
  const std::filesystem::path probe = dir / fmt::format(".kiln-probe-{}", ::getpid());
  FileDescriptor fd(::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) fail(std::strerror(errno));
  const bool wrote = ::write(fd.get(), "x", 1) == 1;
  const int saved_errno = errno;
  fd.close();
  ::unlink(probe.c_str());
  if (!wrote) fail(std::strerror(saved_errno));
}

}  // namespace kiln
