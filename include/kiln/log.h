// Logging to stderr and, once a run directory exists, to its train.log. Thread-safe.
// Lines carry "[kiln]" or, in a distributed run, "[kiln rank R/W]".
#pragma once

#include <filesystem>
#include <string_view>

namespace kiln::log {

enum class Level { kInfo, kWarn, kError };

/// Sets the rank shown in every line (world > 1 shows "rank R/W"). Call once at start.
void set_rank(int rank, int world_size);
/// Also appends every line (with a UTC timestamp) to `file`. Throws UserError if unopenable.
void set_file(const std::filesystem::path& file);
/// Stops writing to the log file (flushes it).
void close_file();

void write(Level level, std::string_view message);
inline void info(std::string_view message) {
  write(Level::kInfo, message);
}
inline void warn(std::string_view message) {
  write(Level::kWarn, message);
}
inline void error(std::string_view message) {
  write(Level::kError, message);
}

/// Draws a one-line status (a progress bar) on stderr, replacing the previous one with a carriage
/// return and an erase-line escape; log lines written meanwhile clear it first. The caller decides
/// whether stderr is a terminal (run.progress = "auto" draws only then). finish_status() ends it.
void status(std::string_view line);
void finish_status();
/// True when stderr is a terminal.
bool stderr_is_terminal();

}  // namespace kiln::log
