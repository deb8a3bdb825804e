#include "kiln/log.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <mutex>
#include <string>

#include "kiln/error.h"

namespace kiln::log {
namespace {

struct State {
  std::mutex mutex;
  std::string prefix = "[kiln]";
  std::ofstream file;
  bool status_shown = false;
};

State& state() {
  static State s;
  return s;
}

std::string utc_timestamp() {
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
  return buffer;
}

void clear_status_locked(State& s) {
  if (s.status_shown) {
    std::fputs("\r\033[K", stderr);
    s.status_shown = false;
  }
}

}  // namespace

void set_rank(int rank, int world_size) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.prefix = world_size > 1
                 ? "[kiln rank " + std::to_string(rank) + "/" + std::to_string(world_size) + "]"
                 : "[kiln]";
}

void set_file(const std::filesystem::path& file) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (s.file.is_open()) s.file.close();
  s.file.open(file, std::ios::app);
  if (!s.file) throw UserError("cannot open log file " + file.string() + " for writing");
}

void close_file() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (s.file.is_open()) s.file.close();
}

void write(Level level, std::string_view message) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  const char* tag = level == Level::kWarn ? " warning:" : level == Level::kError ? " error:" : "";
  clear_status_locked(s);
  std::fprintf(stderr, "%s%s %.*s\n", s.prefix.c_str(), tag, static_cast<int>(message.size()),
               message.data());
  std::fflush(stderr);
  if (s.file.is_open()) {
    s.file << utc_timestamp() << ' ' << s.prefix << tag << ' ' << message << '\n';
    s.file.flush();
  }
}

bool stderr_is_terminal() {
  return ::isatty(STDERR_FILENO) == 1;
}

void status(std::string_view line) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  std::fprintf(stderr, "\r\033[K%.*s", static_cast<int>(line.size()), line.data());
  std::fflush(stderr);
  s.status_shown = true;
}

void finish_status() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (s.status_shown) {
    std::fputs("\n", stderr);
    std::fflush(stderr);
    s.status_shown = false;
  }
}

}  // namespace kiln::log
