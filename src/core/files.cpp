#include "core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "core/pins.h"
#include "kiln/error.h"

namespace kiln {

std::string errno_text() {
  return std::strerror(errno);
}

FileDescriptor::~FileDescriptor() {
  close();
}

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.release();
  }
  return *this;
}

int FileDescriptor::close() {
  if (fd_ < 0) return 0;
  return ::close(release());
}

void fsync_directory(const std::filesystem::path& dir) {
  FileDescriptor fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) throw UserError("cannot open directory " + dir.string() + ": " + errno_text());
  if (::fsync(fd.get()) != 0)
    throw UserError("cannot fsync directory " + dir.string() + ": " + errno_text());
}

AtomicFile::AtomicFile(std::filesystem::path path)
    : path_(std::move(path)), hash_(XXH3_createState(), XXH3_freeState) {
  tmp_ = path_;
  tmp_ += ".tmp." + std::to_string(::getpid());
  fd_ = FileDescriptor(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd_.valid()) throw UserError("cannot write " + tmp_.string() + ": " + errno_text());
  XXH3_64bits_reset(hash_.get());
}

AtomicFile::~AtomicFile() {
  if (!committed_) {
    fd_.close();
    ::unlink(tmp_.c_str());
  }
}

void AtomicFile::write(const void* data, size_t bytes) {
  XXH3_64bits_update(hash_.get(), data, bytes);
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd_.get(), p, std::min<size_t>(bytes, size_t{1} << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw UserError("cannot write " + path_.string() + ": " + errno_text());
    if (n == 0) throw UserError("cannot write " + path_.string() + ": no progress (device full?)");
    p += n;
    bytes -= static_cast<size_t>(n);
    bytes_written_ += static_cast<uint64_t>(n);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_.get()) != 0)
    throw UserError("cannot write " + path_.string() + ": " + errno_text());
  if (fd_.close() != 0) throw UserError("cannot write " + path_.string() + ": " + errno_text());
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    throw UserError("cannot rename " + tmp_.string() + " to " + path_.string() + ": " +
                    errno_text());
  }
  committed_ = true;
  fsync_directory(path_.has_parent_path() ? path_.parent_path() : std::filesystem::path("."));
}

void write_file_atomic(const std::filesystem::path& path, std::string_view bytes) {
  AtomicFile file(path);
  file.write(bytes);
  file.commit();
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError("cannot read " + path.string() + ": " + errno_text());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

uint64_t hash_file(const std::filesystem::path& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) throw UserError("cannot read " + path.string() + ": " + errno_text());
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 XXH3_freeState);
  XXH3_64bits_reset(state.get());
  std::vector<char> buffer(1 << 20);
  while (true) {
    ssize_t n = ::read(fd.get(), buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw UserError("cannot read " + path.string() + ": " + errno_text());
    if (n == 0) break;
    XXH3_64bits_update(state.get(), buffer.data(), static_cast<size_t>(n));
  }
  return XXH3_64bits_digest(state.get());
}

namespace {

std::filesystem::path hash_cache_file() {
  if (const char* explicit_file = std::getenv("KILN_HASH_CACHE"); explicit_file && *explicit_file)
    return explicit_file;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
    return std::filesystem::path(xdg) / "kiln" / "file-hashes.json";
  if (const char* home = std::getenv("HOME"); home && *home)
    return std::filesystem::path(home) / ".cache" / "kiln" / "file-hashes.json";
  return {};
}

}  // namespace

uint64_t hash_file_cached(const std::filesystem::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw UserError("cannot read " + path.string() + ": " + errno_text());
  std::error_code ec;
  const std::string key = std::filesystem::absolute(path, ec).string();
  const int64_t mtime_ns =
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  const std::filesystem::path cache = hash_cache_file();
  nlohmann::json entries = nlohmann::json::object();
  if (!cache.empty()) {
    std::ifstream in(cache);
    if (in) {
      entries = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (!entries.is_object()) entries = nlohmann::json::object();
    }
    auto it = entries.find(key);
    if (it != entries.end() && it->is_object() && it->value("size", int64_t{-1}) == st.st_size &&
        it->value("mtime_ns", int64_t{-1}) == mtime_ns && it->contains("xxh3")) {
      return std::stoull(it->at("xxh3").get<std::string>(), nullptr, 16);
    }
  }
  const uint64_t hash = hash_file(path);
  if (!cache.empty()) {
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(hash));
    entries[key] = {
        {"size", static_cast<int64_t>(st.st_size)}, {"mtime_ns", mtime_ns}, {"xxh3", hex}};
    try {
      std::filesystem::create_directories(cache.parent_path(), ec);
      write_file_atomic(cache, entries.dump(1) + "\n");
    } catch (const std::exception&) {
      // advisory: the hash stands without the cache
    }
  }
  return hash;
}

std::string join_command_line(int argc, const char* const* argv) {
  std::string out;
  for (int k = 0; k < argc; ++k) {
    std::string arg = argv[k];
    bool plain =
        !arg.empty() && arg.find_first_of(" \t\n'\"\\$`*?[]{}()<>|&;#~") == std::string::npos;
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
