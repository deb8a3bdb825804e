#include "core/stop_signals.h"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <mutex>

namespace kiln {
namespace {

std::atomic<int> g_signal{0};
std::atomic<int> g_timeout_seconds{0};
std::atomic<int64_t> g_requested_at_ms{0};
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free,
              "the signal handler needs lock-free atomics");

int64_t monotonic_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

void on_stop_signal(int signal) {
  const int saved_errno = errno;
  int expected = 0;
  if (g_signal.compare_exchange_strong(expected, signal)) {
    g_requested_at_ms.store(monotonic_ms());
    if (const int timeout = g_timeout_seconds.load(); timeout > 0)
      ::alarm(static_cast<unsigned>(timeout));
  } else if (signal == SIGTERM && monotonic_ms() - g_requested_at_ms.load() >= 1000) {
    // A second SIGTERM: stop at once (a launcher's copy of the first arrives within the second).
    ::signal(SIGTERM, SIG_DFL);
    ::raise(SIGTERM);
  }
  errno = saved_errno;
}

}  // namespace

void install_stop_signals(int timeout_seconds) {
  g_timeout_seconds.store(timeout_seconds);
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    ::sigaction(SIGTERM, &action, nullptr);
    ::sigaction(SIGUSR1, &action, nullptr);
  });
}

int stop_signal() {
  return g_signal.load();
}

const char* stop_signal_name(int signal) {
  switch (signal) {
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    default:
      return "a signal";
  }
}

}  // namespace kiln
