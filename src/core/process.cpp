#include "core/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string_view>

#include "kiln/error.h"
#include "kiln/run.h"

extern char** environ;

namespace kiln {

std::filesystem::path kiln_executable() {
  if (const char* path = std::getenv("KILN_EXECUTABLE"); path && *path) return path;
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec && self.filename() == "kiln") return self;
  if (!ec) {
    for (const auto& candidate :
         {self.parent_path() / "kiln", self.parent_path().parent_path() / "kiln"}) {
      if (::access(candidate.c_str(), X_OK) == 0 &&
          std::filesystem::is_regular_file(candidate, ec)) {
        return candidate;
      }
    }
  }
  throw UserError("cannot find the kiln executable to start; set KILN_EXECUTABLE=/path/to/kiln");
}

pid_t spawn_process(const std::vector<std::string>& argv, const std::filesystem::path& log,
                    const std::vector<std::pair<std::string, std::string>>& overrides) {
  if (argv.empty()) throw UserError("spawn_process: empty command");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!log.empty()) {
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The child runs under this process's directory locks (kiln/run.h): KILN_RUN_LOCK names them.
  const std::string handoff = run_lock_handoff();
  const std::string prefix = std::string(kRunLockEnv) + "=";
  std::vector<std::string> assignments;
  auto overridden = [&](std::string_view assignment) {
    if (assignment.rfind(prefix, 0) == 0) return true;
    for (const auto& [name, value] : overrides) {
      if (assignment.size() > name.size() && assignment.rfind(name, 0) == 0 &&
          assignment[name.size()] == '=')
        return true;
    }
    return false;
  };
  for (char** e = environ; *e != nullptr; ++e) {
    if (!overridden(*e)) assignments.emplace_back(*e);
  }
  if (!handoff.empty()) assignments.push_back(prefix + handoff);
  for (const auto& [name, value] : overrides) assignments.push_back(name + "=" + value);
  std::vector<char*> env;
  for (auto& a : assignments) env.push_back(a.data());
  env.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw UserError("cannot start " + argv[0] + ": " + std::strerror(rc));
  return pid;
}

int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw UserError(std::string("cannot open a TCP socket: ") + std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  const int error = errno;
  ::close(fd);
  if (!ok) throw UserError(std::string("cannot find a free TCP port: ") + std::strerror(error));
  return ntohs(address.sin_port);
}

int wait_process(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      throw UserError("waiting for process " + std::to_string(pid) +
                      " failed: " + std::strerror(errno));
    }
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown";
}

std::string hostname() {
  char buffer[256] = {};
  if (::gethostname(buffer, sizeof(buffer) - 1) != 0) return "unknown";
  return buffer;
}

}  // namespace kiln
