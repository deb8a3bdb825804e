// Child processes and facts about this host (not public API). Rungs that prove something across
// processes (the checkpoint drill, the ladder's scale rung) start kiln or torchrun through these.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

/// The kiln executable to start children with: $KILN_EXECUTABLE when set; else this process when
/// it is kiln; else a `kiln` next to or one directory above this program (a test binary in
/// build/tests/ finds build/kiln). Throws UserError naming KILN_EXECUTABLE as the fix.
std::filesystem::path kiln_executable();

/// Starts argv (argv[0] is a path) with the current environment, plus KILN_RUN_LOCK naming the
/// directories this process holds (kiln/run.h: the child runs under their lock). With a `log`,
/// stdout and stderr are appended to it; otherwise they are inherited. `env` sets (or replaces)
/// variables in the child's environment only. Returns the child's pid. Throws UserError.
pid_t spawn_process(const std::vector<std::string>& argv, const std::filesystem::path& log = {},
                    const std::vector<std::pair<std::string, std::string>>& env = {});

/// A TCP port that is free on this host now (bound to port 0, then released): for a rendezvous
/// that must not meet the one this process is in. Throws UserError when no socket can be bound.
int free_tcp_port();

/// Waits for a child: its exit status, or 128 + the signal that ended it. Retries on EINTR;
/// throws UserError if the child cannot be waited for.
int wait_process(pid_t pid);

/// The CPU's model name from /proc/cpuinfo ("unknown" when it cannot be read).
std::string cpu_model();

/// This machine's host name ("unknown" when it cannot be read).
std::string hostname();

}  // namespace kiln
