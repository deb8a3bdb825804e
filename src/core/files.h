// File helpers for the library (not public API).
#pragma once

#include <xxhash.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

namespace kiln {

/// strerror(errno) of the calling thread.
std::string errno_text();

/// Owns a POSIX file descriptor; closes it on destruction.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd = -1) : fd_(fd) {}
  ~FileDescriptor();
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(other.release()) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  /// Closes now; returns close()'s result (0, or -1 with errno).
  int close();

 private:
  int fd_;
};

/// Writes a file atomically: bytes go to `<path>.tmp.<pid>`; commit() fsyncs it, renames it over
/// `path` and fsyncs the directory. If commit() is never reached (an error, an exception), the
/// temp file is removed and `path` keeps its previous content. Optionally hashes what it writes
/// (xxh3-64). Every failure is a UserError naming the path (ENOSPC included). One thread.
class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t bytes);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  void commit();
  uint64_t bytes_written() const { return bytes_written_; }
  /// xxh3-64 of everything written so far.
  uint64_t xxh3() const { return XXH3_64bits_digest(hash_.get()); }

 private:
  std::filesystem::path path_, tmp_;
  FileDescriptor fd_;
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hash_;
  uint64_t bytes_written_ = 0;
  bool committed_ = false;
};

/// Writes `bytes` to `path` atomically (AtomicFile). Throws UserError naming the path.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);
/// Whole file as bytes. Throws UserError naming the path.
std::string read_file(const std::filesystem::path& path);
/// fsync a directory (so a rename in it is durable). Throws UserError.
void fsync_directory(const std::filesystem::path& dir);
/// xxh3-64 of a file's content, streamed. Throws UserError.
uint64_t hash_file(const std::filesystem::path& path);
/// Shell-quotes argv into one line.
std::string join_command_line(int argc, const char* const* argv);

}  // namespace kiln
