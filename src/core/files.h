// File helpers for the library (not public API).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace kiln {

/// Writes `bytes` to `path` atomically: a temp file in the same directory, fsync, rename,
/// fsync of the directory. Throws UserError naming the path on any failure (ENOSPC included);
/// the previous content of `path` is intact then.
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
