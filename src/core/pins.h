// Pins: what defines a run beyond the config, for the pilot and `kiln pilot --check-pins`
// (docs/plan.md, "Pins"). Not public API.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kiln {

/// hash_file (core/files.h), remembered by absolute path, size and modification time (ns) in
/// $KILN_HASH_CACHE, else $XDG_CACHE_HOME/kiln/file-hashes.json, else ~/.cache/kiln/...: a large
/// corpus is hashed once. The cache is advisory: an unreadable or unwritable one is ignored.
/// Throws UserError when the file cannot be read.
uint64_t hash_file_cached(const std::filesystem::path& path);

/// The environment a pilot pins: the Python of the build (KILN_PYTHON) and its `pip freeze`, the
/// Debian packages the build uses with their versions (dpkg-query), and when they were recorded.
/// Starts two or three short child processes. Any thread.
nlohmann::json environment_pins();

/// Every difference between a pinned manifest and a current one, one line each ("data.files...:
/// a -> b"; list entries such as packages by line), ignoring what differs on every run
/// (command_line, start_time_utc, device, world_size, the pins' recording time). A revision left
/// unchanged while its content hash changed is named first. Empty when they agree.
std::vector<std::string> manifest_differences(const nlohmann::json& pinned,
                                              const nlohmann::json& current);

}  // namespace kiln
