// Helpers shared by the checkpoint sources (not public API).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kiln/checkpoint.h"
#include "kiln/comm.h"

namespace kiln::ckpt {

inline constexpr const char* kIndexFile = "index.json";
inline constexpr const char* kLatestFile = "latest";
inline constexpr const char* kFormatName = "kiln-checkpoint";

/// "step-<N>" and "step-<N>.tmp".
std::string step_dir_name(int64_t step);
std::string tmp_dir_name(int64_t step);
/// "rank-<r>.safetensors".
std::string rank_file_name(int rank);

/// Collective: every rank passes its error ("" when fine). When any rank has one, every rank
/// throws UserError with the lowest failing rank's message (prefixed "rank r: " when world > 1).
void agree(Communicator& comm, const std::string& local_error);

/// Calls `load` on the committed checkpoints of `dir`, newest first (rank 0's listing, so every
/// rank tries the same ones): one that fails with a UserError (agreed on every rank: `load` must be
/// collective and throw the same on every rank) is reported with log::warn and the previous one is
/// tried. Returns the first success; nullopt when `dir` holds no committed checkpoint; throws
/// UserError when it holds some but none loads. Collective.
std::optional<LoadResult> load_newest(
    const std::filesystem::path& dir, Communicator& comm,
    const std::function<LoadResult(const std::filesystem::path&)>& load);

/// Serialises an index object with its own checksum field "index_xxh3" (xxh3 of the rest).
std::string index_text_with_checksum(nlohmann::json index);

/// prune_checkpoints, never removing step `just_committed` (-1: none): a save that was just
/// committed is never its own retention's victim, whatever the steps around it.
std::vector<std::filesystem::path> prune(const std::filesystem::path& dir, int64_t keep_last_k,
                                         int64_t keep_every, int64_t just_committed);

/// Product of a shape's dimensions.
uint64_t element_count(const std::vector<int64_t>& shape);

}  // namespace kiln::ckpt
