#include "core/files.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include "kiln/error.h"

namespace kiln {
namespace {

std::string errno_text() { return std::strerror(errno); }

}  // namespace

void fsync_directory(const std::filesystem::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) throw UserError("cannot open directory " + dir.string() + ": " + errno_text());
  int rc = ::fsync(fd);
  int saved = errno;
  ::close(fd);
  if (rc != 0) throw UserError("cannot fsync directory " + dir.string() + ": " + std::strerror(saved));
}

void write_file_atomic(const std::filesystem::path& path, std::string_view bytes) {
  std::filesystem::path tmp = path;
  tmp += ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw UserError("cannot write " + tmp.string() + ": " + errno_text());
  const char* data = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::write(fd, data, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::string why = errno_text();
      ::close(fd);
      ::unlink(tmp.c_str());
      throw UserError("cannot write " + path.string() + ": " + why);
    }
    data += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw UserError("cannot write " + path.string() + ": " + why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw UserError("cannot rename " + tmp.string() + " to " + path.string() + ": " + why);
  }
  fsync_directory(path.has_parent_path() ? path.parent_path() : std::filesystem::path("."));
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError("cannot read " + path.string() + ": " + errno_text());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

uint64_t hash_file(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw UserError("cannot read " + path.string() + ": " + errno_text());
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), XXH3_freeState);
  XXH3_64bits_reset(state.get());
  std::vector<char> buffer(1 << 20);
  while (true) {
    ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      std::string why = errno_text();
      ::close(fd);
      throw UserError("cannot read " + path.string() + ": " + why);
    }
    if (n == 0) break;
    XXH3_64bits_update(state.get(), buffer.data(), static_cast<size_t>(n));
  }
  ::close(fd);
  return XXH3_64bits_digest(state.get());
}

std::string join_command_line(int argc, const char* const* argv) {
  std::string out;
  for (int k = 0; k < argc; ++k) {
    std::string arg = argv[k];
    bool plain = !arg.empty() && arg.find_first_of(" \t\n'\"\\$`*?[]{}()<>|&;#~") == std::string::npos;
    if (k) out += ' ';
    if (plain) {
      out += arg;
    } else {
      out += '\'';
      for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
      out += '\'';
    }
  }
  return out;
}

}  // namespace kiln
